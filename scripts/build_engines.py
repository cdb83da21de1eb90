"""Set-up CLI: put a complete models directory in place.

    python scripts/build_engines.py random --size tiny --out models/tiny
    python scripts/build_engines.py download --out models/full [--source modelscope]
    python scripts/build_engines.py verify --out models/tiny

Every subcommand is idempotent: it skips what exists and is valid, and writes the directory's
manifest last. A subcommand is one entry in `COMMANDS`: a function adding its arguments and a function
running it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a file from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from engines.checkpoints import CheckpointError  # noqa: E402

logger = logging.getLogger("build_engines")

DEFAULT_REFERENCE_DIR = REPO_ROOT.parent / "shared" / "reference" / "checkpoints"


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


def _out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="the models directory")


def _random_arguments(parser: argparse.ArgumentParser) -> None:
    _out_argument(parser)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild files that are already valid")
    parser.add_argument("--reference-dir", type=Path, default=DEFAULT_REFERENCE_DIR,
                        help="released checkpoint manifests (*.tsv) a full build is checked against")


def _random(args: argparse.Namespace) -> None:
    from engines.build.synthetic import build_random

    reference = args.reference_dir if args.reference_dir.is_dir() else None
    if args.size == "full" and reference is None:
        logger.warning("no reference manifests at %s: full weights are checked against our modules only",
                       args.reference_dir)
    build_random(args.out, args.size, seed=args.seed, reference_dir=reference, force=args.force)


def _download_arguments(parser: argparse.ArgumentParser) -> None:
    _out_argument(parser)
    parser.add_argument("--source", choices=("huggingface", "modelscope"), default="huggingface")
    parser.add_argument("--voice-wav", type=Path, help="reference clip for the default voice")
    parser.add_argument("--voice-text", help="transcript of --voice-wav")


def _download(args: argparse.Namespace) -> None:
    from engines.build.download import download_models

    download_models(args.out, args.source, voice_clip=args.voice_wav, voice_text=args.voice_text)


def _verify(args: argparse.Namespace) -> None:
    from engines.build.manifest import check_manifest
    from engines.build.verify import verify_models_dir
    from engines.config import ModelConfigs

    manifest = check_manifest(args.out)
    verify_models_dir(args.out, ModelConfigs.for_size(manifest["size"]))
    logger.info("%s: %s models, %d files, all valid", args.out, manifest["size"], len(manifest["files"]))


# -- accelerated paths: engines/build/tensorrt.py ------------------------------------------------------


def _stage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", "--models", dest="out", type=Path, required=True,
                        help="the models directory")
    parser.add_argument("--force", action="store_true", help="rebuild outputs that are up to date")


def _convert_hf_arguments(parser: argparse.ArgumentParser) -> None:
    from engines.llm.model import DTYPES

    _stage_arguments(parser)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")


def _convert_hf(args: argparse.Namespace) -> None:
    from engines.build.tensorrt import convert_hf

    convert_hf(args.out, args.dtype, force=args.force)


def _build_trtllm_arguments(parser: argparse.ArgumentParser) -> None:
    from engines.build.tensorrt import LlmDtype, TrtllmBuildOptions

    _stage_arguments(parser)
    defaults = TrtllmBuildOptions()
    parser.add_argument("--dtype", choices=get_args(LlmDtype), default=defaults.dtype)
    for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))


def _build_trtllm(args: argparse.Namespace) -> None:
    from engines.build.tensorrt import TrtllmBuildOptions, build_trtllm

    options = TrtllmBuildOptions(args.dtype, args.max_batch_size, args.max_input_len, args.max_seq_len,
                                 args.max_num_tokens)
    build_trtllm(args.out, options, force=args.force)


def _export_onnx(args: argparse.Namespace) -> None:
    from engines.build.tensorrt import export_onnx

    export_onnx(args.out, force=args.force)


def _build_trt_arguments(parser: argparse.ArgumentParser) -> None:
    from engines.token2wav.trt_pool import PRECISIONS, EstimatorLimits

    _stage_arguments(parser)
    defaults = EstimatorLimits()
    parser.add_argument("--precision", choices=PRECISIONS, default="fp16")
    parser.add_argument("--streams", type=int, default=defaults.streams, help="chunks per estimator call")
    parser.add_argument("--max-frames", type=int, default=defaults.max_frames, help="mel frames per chunk")
    parser.add_argument("--max-cache-frames", type=int, default=defaults.max_cache_frames)
    parser.add_argument("--max-offline-frames", type=int, default=defaults.max_offline_frames)


def _build_trt(args: argparse.Namespace) -> None:
    from engines.build.tensorrt import build_trt
    from engines.token2wav.trt_pool import EstimatorLimits

    limits = EstimatorLimits(streams=args.streams, max_frames=args.max_frames,
                             max_cache_frames=args.max_cache_frames,
                             max_offline_frames=args.max_offline_frames)
    build_trt(args.out, args.precision, limits, force=args.force)


COMMANDS: dict[str, Command] = {
    "random": Command("write synthetic checkpoints with random weights", _random_arguments, _random),
    "download": Command("fetch the released checkpoints (CosyVoice2-0.5B, Step-Audio-2-mini token2wav)",
                        _download_arguments, _download),
    "verify": Command("check a models directory against its manifest and our modules",
                      _out_argument, _verify),
    "convert-hf": Command("llm.pt → Hugging Face Qwen2 directory with the speech vocabulary",
                          _convert_hf_arguments, _convert_hf),
    "build-trtllm": Command("Hugging Face directory → TensorRT-LLM engine (needs tensorrt_llm and a GPU)",
                            _build_trtllm_arguments, _build_trtllm),
    "export-onnx": Command("DiT estimator → ONNX (chunk and offline graphs)", _stage_arguments, _export_onnx),
    "build-trt": Command("ONNX → TensorRT plans for the DiT estimator and CAMPPlus (needs tensorrt, a GPU)",
                         _build_trt_arguments, _build_trt),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(subparsers.add_parser(name, help=command.help))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from engines.build.download import DownloadError
    from engines.build.tensorrt import StageUnavailable

    try:
        COMMANDS[args.command].run(args)
    except (CheckpointError, DownloadError, StageUnavailable) as exc:
        logger.error("%s failed: %s", args.command, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
