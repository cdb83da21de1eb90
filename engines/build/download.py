"""Fetch the released checkpoints into the models-directory layout, verify them, mark the dir complete.

Sources: Hugging Face (`huggingface_hub.snapshot_download`, resumable: files already complete are not
fetched again) or ModelScope (same repository ids; `modelscope` is an optional dependency). Only the
files the service uses are fetched. After the download every checkpoint is checked by names and shapes
against our modules, the `default` voice is made, and the manifest (size "full") is written last.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engines.build.manifest import check_manifest, remove_manifest, write_manifest
from engines.build.synthetic import DEFAULT_VOICE, encode_voice
from engines.build.verify import verify_models_dir
from engines.config import ModelConfigs, ModelPaths, ModelSize
from engines.voice import VoicePrompt
from engines.voice_encoder import VoiceError

logger = logging.getLogger(__name__)

Source = Literal["huggingface", "modelscope"]


class DownloadError(RuntimeError):
    """The checkpoints could not be fetched, or the directory could not be completed."""


@dataclass(frozen=True)
class RemoteModel:
    """One released repository and the part of it the service needs, placed under `root / local_dir`."""

    repo_id: str  # on Hugging Face
    modelscope_id: str
    local_dir: str
    allow_patterns: tuple[str, ...]


COSYVOICE2 = RemoteModel(
    "FunAudioLLM/CosyVoice2-0.5B",
    "iic/CosyVoice2-0.5B",
    "CosyVoice2-0.5B",
    ("llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx", "cosyvoice2.yaml",
     "CosyVoice-BlankEN/*", "asset/*.wav"),
)
STEP_AUDIO2_TOKEN2WAV = RemoteModel(
    "stepfun-ai/Step-Audio-2-mini", "stepfun-ai/Step-Audio-2-mini", "Step-Audio-2-mini", ("token2wav/*",)
)
REMOTE_MODELS = (COSYVOICE2, STEP_AUDIO2_TOKEN2WAV)

# Reference clips that may ship with CosyVoice2-0.5B, with their transcripts.
SHIPPED_PROMPTS = {"asset/zero_shot_prompt.wav": "希望你以后能够做的比我还好呦。"}


def download_models(
    out: Path,
    source: Source = "huggingface",
    voice_clip: Path | None = None,
    voice_text: str | None = None,
) -> Path:
    """Download, verify and complete a full models directory at `out`; returns `out`."""
    out = Path(out)
    remove_manifest(out)
    for model in REMOTE_MODELS:
        fetch(model, out, source)
    return finalize_models_dir(out, "full", source, voice_clip, voice_text)


def fetch(model: RemoteModel, root: Path, source: Source) -> None:
    """Fetch `model`'s files into `root / model.local_dir`, or raise DownloadError saying why."""
    target = root / model.local_dir
    logger.info("fetching %s from %s into %s", model.repo_id, source, target)
    if source == "huggingface":
        _fetch_huggingface(model, target)
    elif source == "modelscope":
        _fetch_modelscope(model, target)
    else:
        raise ValueError(f"unknown source {source!r}; expected 'huggingface' or 'modelscope'")


def _fetch_huggingface(model: RemoteModel, target: Path) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot_download(model.repo_id, local_dir=str(target), allow_patterns=list(model.allow_patterns))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise DownloadError(
            f"could not download {model.repo_id} from Hugging Face: {exc}\n"
            "Check the network (or HF_ENDPOINT / HF_TOKEN), or try `--source modelscope`. "
            "Files already fetched are kept; rerun the same command to resume."
        ) from exc


def _fetch_modelscope(model: RemoteModel, target: Path) -> None:
    try:
        from modelscope import snapshot_download
    except ImportError as exc:
        raise DownloadError("`--source modelscope` needs the modelscope package: "
                            "pip install -e '.[download]'") from exc
    try:
        snapshot_download(
            model.modelscope_id, local_dir=str(target), allow_patterns=list(model.allow_patterns)
        )
    except Exception as exc:  # modelscope has no common error base class; report and stop
        raise DownloadError(f"could not download {model.modelscope_id} from ModelScope: {exc}\n"
                            "Check the network; rerun the same command to resume.") from exc


def finalize_models_dir(
    root: Path,
    size: ModelSize,
    source: str,
    voice_clip: Path | None = None,
    voice_text: str | None = None,
) -> Path:
    """Verify every file of `root`, make the `default` voice if missing, and write the manifest last.

    The default voice comes from `voice_clip`/`voice_text` when given, else from a reference clip
    shipped with CosyVoice2-0.5B; with neither, DownloadError says what to pass.
    """
    root = Path(root)
    paths = ModelPaths(root)
    remove_manifest(root)
    verify_models_dir(root, ModelConfigs.for_size(size))
    voice_file = paths.voices / f"{DEFAULT_VOICE}.safetensors"
    if voice_clip is not None or not _is_voice(voice_file):
        clip, text = _default_voice_source(paths, voice_clip, voice_text)
        paths.voices.mkdir(parents=True, exist_ok=True)
        try:
            encode_voice(paths, clip, text).save(voice_file)
        except VoiceError as exc:
            raise DownloadError(f"cannot make the default voice from {clip}: {exc} ({exc.code})") from exc
        logger.info("made the default voice from %s", clip)
    files = [p for d in (paths.cosyvoice2, paths.step_audio2_token2wav) for p in _model_files(d)]
    write_manifest(root, size, source, [*files, voice_file])
    check_manifest(root, size=size, hashes=False)
    logger.info("%s is complete (%d files)", root, len(files) + 1)
    return root


def _is_voice(path: Path) -> bool:
    try:
        VoicePrompt.load(path)
    except ValueError:
        return False
    return True


def _default_voice_source(paths: ModelPaths, clip: Path | None, text: str | None) -> tuple[Path, str]:
    if clip is not None:
        if not text:
            raise DownloadError("--voice-text (the transcript of --voice-wav) is required")
        return Path(clip), text
    for relative, transcript in SHIPPED_PROMPTS.items():
        if (paths.cosyvoice2 / relative).is_file():
            return paths.cosyvoice2 / relative, transcript
    raise DownloadError(
        "no reference clip ships with these checkpoints, so there is no default voice yet: rerun with "
        "`--voice-wav CLIP --voice-text 'TRANSCRIPT'` (3-10 s of clean speech); downloaded files are kept"
    )


def _model_files(directory: Path) -> list[Path]:
    """Files under `directory`, leaving out download caches and partial files (hidden directories)."""
    return sorted(
        p for p in directory.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )

