"""What a complete models directory must hold, and checks that each file is usable.

Checkpoints are compared by names and shapes with our modules built on the meta device (no weights are
materialised, so a full-size check is cheap); ONNX files must open in onnxruntime with the front-end
contract; the tokenizer must load. Every failure is an `engines.checkpoints.CheckpointError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engines.checkpoints import (
    CheckpointError,
    load_checkpoint,
    read_manifest_tsv,
    require_layout,
    state_shapes,
)
from engines.config import ModelConfigs, ModelPaths


def _llm(cfgs: ModelConfigs) -> nn.Module:
    from engines.llm.model import CosyVoice2LM

    return CosyVoice2LM(cfgs.llm)


def _dit_flow(cfgs: ModelConfigs) -> nn.Module:
    from engines.token2wav.flow_dit import DiTFlow

    return DiTFlow(cfgs.dit_flow)


def _unet_flow(cfgs: ModelConfigs) -> nn.Module:
    from engines.token2wav.flow_unet import UNetFlow

    return UNetFlow(cfgs.unet_flow)


def _hift(cfgs: ModelConfigs) -> nn.Module:
    from engines.token2wav.hift import HiFTGenerator

    return HiFTGenerator(cfgs.hift)


def _hift_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from engines.token2wav.hift import canonical_hift_state

    return canonical_hift_state(state)


def _same_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(state)


@dataclass(frozen=True)
class CheckpointSpec:
    """One `.pt` file of a models directory and the module whose state dict it holds.

    `canonical` maps accepted on-disk naming variants to the module's names; `tied` lists
    (name, source) pairs stored as one tensor in the released file; `reference_tsv` names the
    released file's manifest in `shared/reference/checkpoints/`.
    """

    name: str
    path: Callable[[ModelPaths], Path]
    module: Callable[[ModelConfigs], nn.Module]
    reference_tsv: str
    canonical: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] = _same_names
    tied: tuple[tuple[str, str], ...] = ()


CHECKPOINTS: tuple[CheckpointSpec, ...] = (
    CheckpointSpec(
        "llm", lambda p: p.llm, _llm, "cosyvoice2-0.5b.llm.pt.tsv",
        tied=(("llm.model.lm_head.weight", "llm.model.model.embed_tokens.weight"),),
    ),
    CheckpointSpec("unet_flow", lambda p: p.unet_flow, _unet_flow, "cosyvoice2-0.5b.flow.pt.tsv"),
    CheckpointSpec("cosyvoice2_hift", lambda p: p.cosyvoice2_hift, _hift, "cosyvoice2-0.5b.hift.pt.tsv",
                   canonical=_hift_names),
    CheckpointSpec("dit_flow", lambda p: p.dit_flow, _dit_flow, "step-audio-2-mini.token2wav.flow.pt.tsv"),
    CheckpointSpec("hift", lambda p: p.hift, _hift, "step-audio-2-mini.token2wav.hift.pt.tsv",
                   canonical=_hift_names),
)

# Released CosyVoice-BlankEN/model.safetensors = the LLM's Qwen2 backbone under Hugging Face's names
# (`hf_export.hf_backbone_state`; no lm_head).
BLANKEN_TSV = "cosyvoice2-0.5b.CosyVoice-BlankEN.safetensors.tsv"

TOKENIZER_FILES = ("config.json", "vocab.json", "merges.txt", "tokenizer_config.json")


def meta_module(spec: CheckpointSpec, cfgs: ModelConfigs) -> nn.Module:
    """`spec`'s module at `cfgs`, built on the meta device (shapes only, nothing allocated)."""
    with torch.device("meta"):
        return spec.module(cfgs)


def expected_shapes(spec: CheckpointSpec, cfgs: ModelConfigs) -> dict[str, tuple[int, ...]]:
    return state_shapes(meta_module(spec, cfgs).state_dict())


def verify_checkpoint(path: Path, spec: CheckpointSpec, cfgs: ModelConfigs) -> None:
    """Raise CheckpointError unless `path` holds exactly the names and shapes of `spec`'s module."""
    state = spec.canonical(load_checkpoint(path))
    require_layout(expected_shapes(spec, cfgs), state_shapes(state),
                   f"{path} does not match {spec.name} at size {cfgs.size!r}")


def verify_against_reference(shapes: Mapping[str, tuple[int, ...]], tsv: Path) -> None:
    """Raise CheckpointError unless `shapes` equals the released file's manifest `tsv`."""
    reference = dict(read_manifest_tsv(tsv))
    require_layout(reference, shapes, f"weights differ from the released layout {tsv.name}")


def verify_onnx(path: Path, input_ranks: tuple[int, ...]) -> None:
    """Raise CheckpointError unless `path` opens in onnxruntime with inputs of these ranks."""
    import onnxruntime

    if not path.is_file():
        raise CheckpointError(f"ONNX model {path} does not exist")
    try:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types without a public base class
        raise CheckpointError(f"{path} is not a loadable ONNX model: {exc}") from exc
    ranks = tuple(len(i.shape) for i in session.get_inputs())
    if ranks != input_ranks:
        raise CheckpointError(f"{path} has inputs of ranks {ranks}, expected {input_ranks}")


SPEECH_TOKENIZER_INPUT_RANKS = (3, 1)  # feats (B, 128, T), lengths (B,)
CAMPPLUS_INPUT_RANKS = (3,)  # fbank (B, T, 80)


def onnx_files(paths: ModelPaths) -> dict[Path, tuple[int, ...]]:
    """Every ONNX front-end file of the layout and its input ranks."""
    return {
        paths.speech_tokenizer: SPEECH_TOKENIZER_INPUT_RANKS,
        paths.cosyvoice2 / "speech_tokenizer_v2.onnx": SPEECH_TOKENIZER_INPUT_RANKS,
        paths.campplus: CAMPPLUS_INPUT_RANKS,
        paths.cosyvoice2 / "campplus.onnx": CAMPPLUS_INPUT_RANKS,
    }


def config_files(paths: ModelPaths) -> tuple[Path, ...]:
    """The released yaml configurations (kept for fidelity; our modules take `engines.config`)."""
    return (paths.cosyvoice2 / "cosyvoice2.yaml", paths.step_audio2_token2wav / "flow.yaml")


def verify_tokenizer(directory: Path, text_vocab_size: int) -> None:
    """Raise CheckpointError unless `directory` loads as the text tokenizer with ids < text_vocab_size."""
    from engines.text import TextFrontend

    missing = [name for name in TOKENIZER_FILES if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"tokenizer directory {directory} lacks {', '.join(missing)}")
    try:
        frontend = TextFrontend(directory)
        json.loads((directory / "config.json").read_text())
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"tokenizer {directory} does not load: {exc}") from exc
    if frontend.vocab_size > text_vocab_size:
        raise CheckpointError(f"tokenizer {directory} has {frontend.vocab_size} ids but the LLM embeds only "
                              f"{text_vocab_size}")


def verify_models_dir(root: Path, cfgs: ModelConfigs) -> None:
    """Check every required file of a models directory (checkpoints by names/shapes, ONNX, tokenizer)."""
    paths = ModelPaths(Path(root))
    for path in config_files(paths):
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
    for spec in CHECKPOINTS:
        verify_checkpoint(spec.path(paths), spec, cfgs)
    for path, ranks in onnx_files(paths).items():
        verify_onnx(path, ranks)
    verify_tokenizer(paths.text_tokenizer, cfgs.llm.qwen.vocab_size)
