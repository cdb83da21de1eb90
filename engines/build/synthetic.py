"""A models directory with random weights in exactly the released layout (`engines.config.ModelPaths`).

Checkpoints are our own modules' state dicts (flat fp32 dicts, `torch.save`), the tokenizer a small BPE
in the Qwen2 format, the ONNX front ends tiny stand-ins with the real contracts, plus a `default` voice
made from a generated voiced clip. Every file is written through a temporary name and checked after
writing; a rerun skips files that exist and pass their check; the manifest is written last.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from tqdm import tqdm

from engines.build.manifest import check_manifest, remove_manifest, write_manifest
from engines.build.onnx_models import export_campplus, export_speech_tokenizer
from engines.build.tokenizer import write_qwen2_tokenizer
from engines.build.verify import (
    CAMPPLUS_INPUT_RANKS,
    CHECKPOINTS,
    SPEECH_TOKENIZER_INPUT_RANKS,
    CheckpointSpec,
    config_files,
    meta_module,
    verify_against_reference,
    verify_checkpoint,
    verify_onnx,
    verify_tokenizer,
)
from engines.checkpoints import CheckpointError, load_checkpoint, state_shapes
from engines.config import SAMPLE_RATE, ModelConfigs, ModelPaths, ModelSize
from engines.llm.hf_export import hf_backbone_state, qwen2_hf_config
from engines.voice import VoicePrompt

logger = logging.getLogger(__name__)

DEFAULT_VOICE = "default"
DEFAULT_VOICE_TEXT = "This is the default voice of a synthetic test model."
TOKENIZER_VOCAB = 1500  # below the tiny LLM's 2048 text rows once the special tokens are added


@dataclass(frozen=True)
class Artifact:
    """One file or directory of the build: how to write it and how to tell that an existing one is valid."""

    path: Path
    write: Callable[[Path], object]  # return values are ignored
    check: Callable[[Path], object]  # raises when the file is unusable


def build_random(
    out: Path, size: ModelSize, seed: int = 0, reference_dir: Path | None = None, force: bool = False
) -> Path:
    """Build (or complete) a synthetic models directory at `out`; returns `out`.

    With `reference_dir` (shared/reference/checkpoints) a full build also checks every checkpoint
    against the released names and shapes. `force` rebuilds files that already pass their checks.
    """
    out = Path(out)
    cfgs = ModelConfigs.for_size(size)
    if not force:
        try:
            check_manifest(out, size=size)
        except CheckpointError as exc:
            # The error tells a service user how to build the models; here they are being built.
            reason = "none there yet" if not ModelPaths(out).manifest.is_file() else str(exc)
            logger.info("building %s models in %s (%s)", size, out, reason)
        else:
            logger.info("%s already holds complete %s models: nothing to do", out, size)
            return out
    remove_manifest(out)
    artifacts = synthetic_artifacts(ModelPaths(out), cfgs, seed, reference_dir)
    for artifact in tqdm(artifacts, desc=f"random {size} models", unit="file"):
        build_artifact(artifact, force)
    files = [p for a in artifacts for p in _files_of(a.path)]
    write_manifest(out, size, "random", files, seed=seed)
    logger.info("wrote %s (%d files)", ModelPaths(out).manifest, len(files))
    return out


def build_artifact(artifact: Artifact, force: bool = False) -> None:
    """Write `artifact` unless a valid one exists; a half-written one never takes the final name."""
    path = artifact.path
    if path.exists() and not force:
        try:
            artifact.check(path)
        except (CheckpointError, OSError, ValueError, RuntimeError) as exc:
            logger.warning("rebuilding %s: %s", path, exc)
        else:
            logger.info("kept %s (valid)", path)
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    _remove(partial)
    artifact.write(partial)
    _remove(path)
    partial.replace(path)
    artifact.check(path)
    logger.info("wrote %s", path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def synthetic_artifacts(
    paths: ModelPaths, cfgs: ModelConfigs, seed: int, reference_dir: Path | None
) -> list[Artifact]:
    """Every file of a synthetic models directory, in build order (later ones may read earlier ones)."""
    text_vocab = cfgs.llm.qwen.vocab_size
    artifacts = [
        Artifact(
            spec.path(paths),
            _checkpoint_writer(spec, cfgs, seed + index, reference_dir),
            partial(verify_checkpoint, spec=spec, cfgs=cfgs),
        )
        for index, spec in enumerate(CHECKPOINTS)
    ]
    speech_tokenizer_copy = paths.cosyvoice2 / "speech_tokenizer_v2.onnx"
    campplus_copy = paths.cosyvoice2 / "campplus.onnx"
    artifacts += [
        Artifact(paths.text_tokenizer, lambda p: _write_tokenizer_dir(p, paths, cfgs),
                 lambda p: verify_tokenizer(p, text_vocab)),
        Artifact(paths.speech_tokenizer, lambda p: export_speech_tokenizer(p, seed),
                 lambda p: verify_onnx(p, SPEECH_TOKENIZER_INPUT_RANKS)),
        Artifact(speech_tokenizer_copy, lambda p: shutil.copyfile(paths.speech_tokenizer, p),
                 lambda p: verify_onnx(p, SPEECH_TOKENIZER_INPUT_RANKS)),
        Artifact(paths.campplus, lambda p: export_campplus(p, seed + 1),
                 lambda p: verify_onnx(p, CAMPPLUS_INPUT_RANKS)),
        Artifact(campplus_copy, lambda p: shutil.copyfile(paths.campplus, p),
                 lambda p: verify_onnx(p, CAMPPLUS_INPUT_RANKS)),
    ]
    cosyvoice2_yaml, flow_yaml = config_files(paths)
    cosyvoice2_sections = {"llm": cfgs.llm, "flow": cfgs.unet_flow, "hift": cfgs.hift}
    clip = paths.voices / f"{DEFAULT_VOICE}.wav"
    artifacts += [
        Artifact(cosyvoice2_yaml, lambda p: _write_yaml(p, cosyvoice2_sections, cfgs.size), _check_yaml),
        Artifact(flow_yaml, lambda p: _write_yaml(p, {"flow": cfgs.dit_flow}, cfgs.size), _check_yaml),
        Artifact(clip, _write_default_clip, _check_clip),
        Artifact(paths.voices / f"{DEFAULT_VOICE}.safetensors",
                 lambda p: encode_voice(paths, clip, DEFAULT_VOICE_TEXT).save(p), VoicePrompt.load),
    ]
    return artifacts


def _checkpoint_writer(
    spec: CheckpointSpec, cfgs: ModelConfigs, seed: int, reference_dir: Path | None
) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        state = random_state(spec, cfgs, seed)
        if reference_dir is not None and cfgs.size == "full":
            verify_against_reference(state_shapes(state), reference_dir / spec.reference_tsv)
        torch.save(state, path)

    return write


def random_state(spec: CheckpointSpec, cfgs: ModelConfigs, seed: int) -> dict[str, torch.Tensor]:
    """A random flat fp32 state dict for `spec`'s module (tied names share one tensor, as released).

    Every tensor is drawn, so that tests exercise all the arithmetic (a missing bias or norm affine
    changes the output): matrices and kernels N(0, 1/(3·fan-in)) (the scale of PyTorch's default
    init), norm scales and Snake α 1 + 0.1·N, biases and other vectors 0.05·N, weight-norm magnitudes
    ‖v‖·(1 + 0.1·N) (so each kernel starts near its direction v, as weight_norm initialises it). HiFT's
    F0 head is then calibrated to voiced pitch (`_voice_f0_head`). The module is built on the meta device
    for names, shapes and layer kinds only: the full LLM's own initialisation takes minutes on a CPU.
    """
    generator = torch.Generator().manual_seed(seed)
    module = meta_module(spec, cfgs)
    scales = _scale_names(module)
    state: dict[str, torch.Tensor] = {}
    for name, meta in module.state_dict().items():
        state[name] = _draw(name, meta.shape, meta.dtype, name in scales, generator)
    for name in state:
        if name.endswith(WEIGHT_NORM_MAGNITUDE):
            direction = state[name[: -len(WEIGHT_NORM_MAGNITUDE)] + WEIGHT_NORM_DIRECTION]
            norm = direction.flatten(1).norm(dim=1).view(state[name].shape)
            state[name] = norm * (1 + 0.1 * torch.randn(norm.shape, generator=generator))
    for name, source in spec.tied:
        state[name] = state[source]
    from engines.token2wav.hift import HiFTGenerator

    if isinstance(module, HiFTGenerator):
        _voice_f0_head(state, cfgs, generator)
    return state


WEIGHT_NORM_MAGNITUDE = ".parametrizations.weight.original0"
WEIGHT_NORM_DIRECTION = ".parametrizations.weight.original1"
F0_MEAN_HZ, F0_SPREAD_HZ = 150.0, 30.0


def _scale_names(module: torch.nn.Module) -> set[str]:
    """State names that multiply a signal and are 1 at init: norm gains and Snake α."""
    names = set()
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        if type(sub).__name__.endswith("Norm") and isinstance(getattr(sub, "weight", None), torch.Tensor):
            names.add(f"{dot}weight")
        if isinstance(getattr(sub, "alpha", None), torch.nn.Parameter):
            names.add(f"{dot}alpha")
    return names


def _draw(name: str, shape: torch.Size, dtype: torch.dtype, scale: bool,
          generator: torch.Generator) -> torch.Tensor:
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    noise = torch.randn(shape, generator=generator, dtype=dtype)
    if scale:
        return 1 + 0.1 * noise
    if len(shape) >= 2:
        fan_in = noise[0].numel()
        return noise / (3 * fan_in) ** 0.5
    return 0.05 * noise


def _voice_f0_head(state: dict[str, torch.Tensor], cfgs: ModelConfigs, generator: torch.Generator) -> None:
    """Scale HiFT's F0 classifier so that it predicts voiced pitch: F0_MEAN_HZ on average and a spread of
    F0_SPREAD_HZ over two kinds of input (standard-normal mels and the log-mel of the default voice's
    clip), so the harmonic source runs (most frames 80–300 Hz) and its pitch moves with the mel."""
    from engines.audio_features import flow_mel
    from engines.token2wav.hift import HiFTGenerator

    hift = HiFTGenerator(cfgs.hift)
    hift.load_state_dict(state)
    clip_mel = flow_mel(voiced_clip()).T[None]  # (1, 80, T)
    noise_mel = torch.randn(1, cfgs.hift.in_channels, clip_mel.shape[2], generator=generator)
    with torch.no_grad():
        features = hift.f0_predictor.condnet(torch.cat([clip_mel, noise_mel])).transpose(1, 2)
        raw = hift.f0_predictor.classifier.weight @ features.reshape(-1, features.shape[2]).T
    scale = F0_SPREAD_HZ / float(raw.std())
    state["f0_predictor.classifier.weight"] = state["f0_predictor.classifier.weight"] * scale
    state["f0_predictor.classifier.bias"] = torch.tensor([F0_MEAN_HZ - scale * float(raw.mean())])


def _write_tokenizer_dir(directory: Path, paths: ModelPaths, cfgs: ModelConfigs) -> None:
    """Tokenizer files, the Qwen2 `config.json` and the backbone weights (`model.safetensors`, bf16)."""
    from safetensors.torch import save_file

    num_ids = write_qwen2_tokenizer(directory, TOKENIZER_VOCAB, cfgs.llm.qwen.max_position_embeddings)
    eos_id = num_ids - 3  # `<|endoftext|>` is the first Qwen2 special token after the trained vocabulary
    (directory / "config.json").write_text(json.dumps(_qwen2_config(cfgs, eos_id), indent=2) + "\n")
    backbone = {name: tensor.to(torch.bfloat16).contiguous()
                for name, tensor in hf_backbone_state(load_checkpoint(paths.llm)).items()}
    save_file(backbone, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _qwen2_config(cfgs: ModelConfigs, eos_id: int) -> dict[str, Any]:
    """BlankEN's `config.json`: the plain Qwen2 LM, text vocabulary and tied head."""
    return {
        **qwen2_hf_config(cfgs.llm.qwen),
        "vocab_size": cfgs.llm.qwen.vocab_size,
        "tie_word_embeddings": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def _write_yaml(path: Path, sections: dict[str, Any], size: ModelSize) -> None:
    plain = json.loads(json.dumps({name: asdict(cfg) for name, cfg in sections.items()}))
    header = f"# Synthetic {size} models: random weights with these architectures (engines.config).\n"
    path.write_text(header + yaml.safe_dump(plain, sort_keys=False))


def _check_yaml(path: Path) -> None:
    if not isinstance(yaml.safe_load(path.read_text()), dict):
        raise ValueError(f"{path} is not a yaml mapping")


def voiced_clip(seconds: float = 4.0, sample_rate: int = SAMPLE_RATE, seed: int = 0) -> np.ndarray:
    """A deterministic speech-like float32 clip: a harmonic tone with a gliding pitch, shaped into
    syllables by raised-cosine envelopes, with a little breath noise. Peak 0.5."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = 140.0 + 30.0 * np.sin(2 * np.pi * 0.7 * t) + 10.0 * np.sin(2 * np.pi * 3.1 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    # Harmonics fall off as 1/h with a broad "formant" bump around 500-900 Hz.
    tone = sum(np.sin(h * phase) / h * (1.0 + 2.0 * np.exp(-(((h * 140.0) - 700.0) / 300.0) ** 2))
               for h in range(1, 16))
    syllable_rate = 4.0  # per second
    syllable_phase = (t * syllable_rate) % 1.0
    envelope = np.where(syllable_phase < 0.8, np.sin(np.pi * syllable_phase / 0.8) ** 2, 0.0)
    clip = tone * envelope + 0.01 * rng.standard_normal(t.size)
    return (0.5 * clip / np.abs(clip).max()).astype(np.float32)


def _write_default_clip(path: Path) -> None:
    import soundfile

    soundfile.write(str(path), voiced_clip(), SAMPLE_RATE, subtype="PCM_16", format="WAV")


def _check_clip(path: Path) -> None:
    import soundfile

    info = soundfile.info(str(path))
    if info.samplerate != SAMPLE_RATE or info.frames < SAMPLE_RATE:
        raise ValueError(f"{path} is not a clip of at least 1 s at {SAMPLE_RATE} Hz")


def encode_voice(paths: ModelPaths, clip: Path, transcript: str) -> VoicePrompt:
    """The voice prompt of `clip` computed with the directory's own ONNX front ends."""
    from engines.voice_encoder import VoiceEncoder

    return VoiceEncoder(paths.speech_tokenizer, paths.campplus, device="cpu").encode(Path(clip), transcript)
