"""Build stages for the accelerated paths (run by `scripts/build_engines.py`):

  convert-hf    llm.pt → Hugging Face Qwen2 directory with the speech vocabulary    (no GPU needed)
  build-trtllm  that directory → TensorRT-LLM checkpoint → engine (`trtllm-build`)  (tensorrt_llm, GPU)
  export-onnx   the DiT estimator → ONNX, chunk and offline graphs                  (no GPU needed)
  build-trt     ONNX → TensorRT plans with optimisation profiles; CAMPPlus too      (tensorrt, GPU)

Each stage returns False and does nothing when its output exists and is valid: the output is complete
and a stamp next to it records the same inputs (file sizes and times) and options. Outputs are written
under temporary names and moved into place last. A stage that needs a library that is missing raises
`StageUnavailable` saying what to install.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from engines.config import ModelPaths, configs_for_models_dir
from engines.llm.hf_export import export_hf, is_exported
from engines.llm.model import DTYPES
from engines.llm.trtllm import engine_dir
from engines.token2wav.dit import DiT
from engines.token2wav.onnx_export import (
    CHUNK_INPUTS,
    OFFLINE_INPUTS,
    export_chunk_estimator,
    export_offline_estimator,
)
from engines.token2wav.trt_pool import (
    EstimatorLimits,
    Precision,
    Profile,
    TrtArtifacts,
    chunk_profile,
    import_tensorrt,
    offline_profile,
)

logger = logging.getLogger(__name__)

LlmDtype = Literal["bfloat16", "float16"]
CAMPPLUS_PROFILE_FRAMES = (4, 300, 3000)  # fbank frames (10 ms): min, opt, max (MODEL_FACTS §2.2)
STAMP_SUFFIX = ".stamp.json"


class StageUnavailable(RuntimeError):
    """A stage cannot run on this machine (a library is missing) or before another stage."""


# -- stamps: what an output was built from ---------------------------------------------------------------


def _file_info(path: Path) -> dict[str, Any]:
    # The name, not the path: a models directory may be mounted elsewhere later.
    stat = Path(path).stat()
    return {"name": Path(path).name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _stamp_path(output: Path) -> Path:
    return output.with_name(output.name + STAMP_SUFFIX)


def _stamp(sources: list[Path], options: dict[str, Any]) -> dict[str, Any]:
    return {"sources": [_file_info(p) for p in sources], "options": options}


def is_current(output: Path, sources: list[Path], options: dict[str, Any]) -> bool:
    """Whether `output` exists and was built from these very `sources` with these `options`."""
    try:
        recorded = json.loads(_stamp_path(output).read_text())
        return output.exists() and recorded == _stamp(sources, options)
    except (OSError, json.JSONDecodeError):
        return False


def _write_stamp(output: Path, sources: list[Path], options: dict[str, Any]) -> None:
    _stamp_path(output).write_text(json.dumps(_stamp(sources, options), indent=2) + "\n")


def _require(path: Path, stage: str) -> None:
    if not path.exists():
        raise StageUnavailable(f"{path} is missing: run `build_engines.py {stage}` first")


# -- convert-hf ----------------------------------------------------------------------------------------


def convert_hf(models_dir: Path, dtype: str = "bfloat16", force: bool = False) -> bool:
    """llm.pt (+ the text tokenizer) → `ModelPaths.hf_llm`; True when it wrote the export."""
    paths = ModelPaths(Path(models_dir))
    sources = [paths.llm, paths.text_tokenizer / "vocab.json"]
    options = {"dtype": dtype}
    if not force and is_exported(paths.hf_llm) and is_current(paths.hf_llm, sources, options):
        logger.info("convert-hf: %s is up to date", paths.hf_llm)
        return False
    for source in sources:
        _require(source, "download` or `random")
    logger.info("convert-hf: %s → %s (%s)", paths.llm, paths.hf_llm, dtype)
    tmp = paths.hf_llm.with_name(paths.hf_llm.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export_hf(paths.llm, paths.text_tokenizer, tmp, configs_for_models_dir(paths.root).llm, DTYPES[dtype])
    shutil.rmtree(paths.hf_llm, ignore_errors=True)
    tmp.replace(paths.hf_llm)
    _write_stamp(paths.hf_llm, sources, options)
    return True


# -- build-trtllm --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrtllmBuildOptions:
    """`trtllm-build` sizes. max_seq_len bounds prompt + speech tokens of one request (2560 ≈ the
    reference runtime's KV window); max_num_tokens bounds the tokens of one in-flight batch step."""

    dtype: LlmDtype = "bfloat16"
    max_batch_size: int = 16
    max_input_len: int = 1024
    max_seq_len: int = 2560
    max_num_tokens: int = 16384

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(f"max_input_len {self.max_input_len} must be below max_seq_len "
                             f"{self.max_seq_len}")


def trtllm_build_command(checkpoint_dir: Path, output_dir: Path, options: TrtllmBuildOptions) -> list[str]:
    """The `trtllm-build` invocation; logits stay float32 so the float32 `embedding_bias` matches them."""
    return [
        "trtllm-build",
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(output_dir),
        "--max_batch_size", str(options.max_batch_size),
        "--max_input_len", str(options.max_input_len),
        "--max_seq_len", str(options.max_seq_len),
        "--max_num_tokens", str(options.max_num_tokens),
        "--gemm_plugin", options.dtype,
        "--logits_dtype", "float32",
    ]


def build_trtllm(models_dir: Path, options: TrtllmBuildOptions, force: bool = False) -> bool:
    """Hugging Face export → TensorRT-LLM checkpoint → engine in `trtllm.engine_dir`; True when built."""
    paths = ModelPaths(Path(models_dir))
    out = engine_dir(paths.root)
    sources = [paths.hf_llm / "model.safetensors"]
    if not force and (out / "config.json").is_file() and is_current(out, sources, asdict(options)):
        logger.info("build-trtllm: %s is up to date", out)
        return False
    if not is_exported(paths.hf_llm):
        raise StageUnavailable(f"{paths.hf_llm} is not a complete export: run `build_engines.py convert-hf` "
                               "first")
    if importlib.util.find_spec("tensorrt_llm") is None or shutil.which("trtllm-build") is None:
        raise StageUnavailable("build-trtllm needs TensorRT-LLM (the tensorrt_llm package and its "
                               "trtllm-build command) on a CUDA host, e.g. the "
                               "nvcr.io/nvidia/tensorrt-llm/release image")
    from tensorrt_llm.mapping import Mapping  # type: ignore[import-not-found]
    from tensorrt_llm.models import QWenForCausalLM  # type: ignore[import-not-found]

    checkpoint = paths.engines / "trtllm-checkpoint"
    logger.info("build-trtllm: converting %s to a TensorRT-LLM checkpoint (%s)", paths.hf_llm, options.dtype)
    shutil.rmtree(checkpoint, ignore_errors=True)
    model = QWenForCausalLM.from_hugging_face(str(paths.hf_llm), options.dtype, mapping=Mapping(world_size=1))
    model.save_checkpoint(str(checkpoint), save_config=True)
    del model
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    command = trtllm_build_command(checkpoint, tmp, options)
    logger.info("build-trtllm: %s", " ".join(command))
    subprocess.run(command, check=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    shutil.rmtree(checkpoint, ignore_errors=True)
    _write_stamp(out, sources, asdict(options))
    return True


# -- export-onnx ---------------------------------------------------------------------------------------


def export_onnx(models_dir: Path, force: bool = False) -> bool:
    """The DiT estimator of the Step-Audio2 flow → chunk and offline ONNX graphs; True when written."""
    paths, artifacts = ModelPaths(Path(models_dir)), TrtArtifacts(Path(models_dir))
    outputs = {artifacts.dit_chunk_onnx: CHUNK_INPUTS, artifacts.dit_offline_onnx: OFFLINE_INPUTS}
    sources = [paths.dit_flow]
    current = all(_onnx_inputs(p) == names and is_current(p, sources, {}) for p, names in outputs.items())
    if not force and current:
        logger.info("export-onnx: %s is up to date", artifacts.onnx_dir)
        return False
    _require(paths.dit_flow, "download` or `random")
    from engines.token2wav.flow_dit import load_dit_flow

    flow = load_dit_flow(paths.dit_flow, configs_for_models_dir(paths.root).dit_flow, "cpu", torch.float32)
    estimator = flow.decoder.estimator
    assert isinstance(estimator, DiT), "DiTFlow's estimator is a DiT"
    for path, export in ((artifacts.dit_chunk_onnx, export_chunk_estimator),
                         (artifacts.dit_offline_onnx, export_offline_estimator)):
        logger.info("export-onnx: %s", path)
        export(estimator, path)
        _write_stamp(path, sources, {})
    return True


def _onnx_inputs(path: Path) -> tuple[str, ...] | None:
    """The graph input names of an ONNX file, or None when it is missing or unreadable."""
    import onnx
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except (OSError, DecodeError):
        return None
    return tuple(i.name for i in graph.input)


# -- build-trt -----------------------------------------------------------------------------------------


def build_plan(onnx_path: Path, plan_path: Path, profile: Profile, precision: Precision,
               workspace_gb: float = 4.0) -> None:
    """Parse `onnx_path`, build a plan with one optimisation profile, write it to `plan_path`.

    fp16/bf16 plans keep normalisation layers in fp32 (LayerNorm overflows in fp16 otherwise).
    """
    trt = import_tensorrt()
    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, trt_logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    if precision != "fp32":
        config.set_flag(trt.BuilderFlag.FP16 if precision == "fp16" else trt.BuilderFlag.BF16)
        config.set_flag(trt.BuilderFlag.PREFER_PRECISION_CONSTRAINTS)
        for index in range(network.num_layers):
            layer = network.get_layer(index)
            if layer.type == trt.LayerType.NORMALIZATION:
                layer.precision = trt.float32
                layer.set_output_type(0, trt.float32)
    optimisation = builder.create_optimization_profile()
    for name, (low, opt, high) in profile.items():
        optimisation.set_shape(name, low, opt, high)
    config.add_optimization_profile(optimisation)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build a plan from {onnx_path} (see its log above)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = plan_path.with_name(plan_path.name + ".tmp")
    tmp.write_bytes(bytes(plan))
    tmp.replace(plan_path)


def campplus_profile(onnx_path: Path) -> Profile:
    """One utterance of fbank frames (1, T, 80) on CAMPPlus's only input, whatever its name."""
    import onnx

    name = onnx.load(str(onnx_path), load_external_data=False).graph.input[0].name
    low, opt, high = CAMPPLUS_PROFILE_FRAMES
    return {name: ((1, low, 80), (1, opt, 80), (1, high, 80))}


@dataclass(frozen=True)
class _PlanJob:
    onnx: Path
    plan: Path
    precision: Precision
    profile: Callable[[], Profile]  # called once the ONNX file is known to exist
    options: dict[str, Any]


def _plan_jobs(models_dir: Path, precision: Precision, limits: EstimatorLimits) -> list[_PlanJob]:
    paths, artifacts = ModelPaths(Path(models_dir)), TrtArtifacts(Path(models_dir))
    dit = configs_for_models_dir(paths.root).dit_flow.dit
    dit_options = {"precision": precision, "limits": asdict(limits)}
    return [
        _PlanJob(artifacts.dit_chunk_onnx, artifacts.dit_chunk_plan(precision), precision,
                 lambda: chunk_profile(dit, limits), dit_options),
        _PlanJob(artifacts.dit_offline_onnx, artifacts.dit_offline_plan(precision), precision,
                 lambda: offline_profile(dit, limits), dit_options),
        _PlanJob(paths.campplus, artifacts.campplus_plan, "fp32", lambda: campplus_profile(paths.campplus),
                 {"precision": "fp32"}),
    ]


def build_trt(
    models_dir: Path,
    precision: Precision = "fp16",
    limits: EstimatorLimits | None = None,
    force: bool = False,
) -> bool:
    """TensorRT plans for the DiT estimator (chunk and offline) and CAMPPlus; True when any was built."""
    jobs = _plan_jobs(models_dir, precision, limits or EstimatorLimits())
    pending = [job for job in jobs if force or not is_current(job.plan, [job.onnx], job.options)]
    if not pending:
        logger.info("build-trt: %s is up to date", TrtArtifacts(Path(models_dir)).plan_dir)
        return False
    for job in pending:
        _require(job.onnx, "export-onnx")
    try:
        trt = import_tensorrt()
    except RuntimeError as exc:
        raise StageUnavailable(f"build-trt needs TensorRT: {exc}") from exc
    logger.info("build-trt: TensorRT %s", trt.__version__)
    for job in pending:
        logger.info("build-trt: %s → %s (%s)", job.onnx.name, job.plan, job.precision)
        build_plan(job.onnx, job.plan, job.profile(), job.precision)
        _write_stamp(job.plan, [job.onnx], job.options)
    return True
