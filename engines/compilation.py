"""How a CUDA process of the engines compiles: float32 matmul precision and where Inductor keeps what it
builds.

- `use_tf32_matmuls`: float32 matrix products on tensor cores (TF32), declared through the precision
  API of torch ≥ 2.9 (`fp32_precision`), which Inductor reads when it compiles float32 graphs.
- `compile_cache_dir`: Inductor's and Triton's on-disk caches for one models directory, GPU and torch
  version, kept beside the models (a container's models volume outlives the container), so that a
  restart loads the compiled kernels instead of compiling them again: Inductor's kernels and our own
  Triton kernels (the LLM's decode attention) alike. `host_cache_dir`: beside them, what no device
  shapes (the built text tokenizer).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
COMPILE_CACHE = "compile-cache"  # beside the models: a container's models volume outlives the container
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def use_tf32_matmuls() -> None:
    """float32 matmuls and convolutions of this process on TF32 tensor cores (~1e-3 relative rounding,
    like cuDNN's default for convolutions). Process-wide by nature: torch keeps one setting."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "tf32"  # type: ignore[attr-defined]


def device_name(device: torch.device) -> str:
    """What compiled code is built for: the GPU model (its name), or the device type elsewhere."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def compile_cache_dir(models_dir: Path, device: torch.device) -> Path:
    """The folder of compiled artifacts for `models_dir` on `device`'s GPU model with this torch."""
    key = re.sub(r"[^A-Za-z0-9.]+", "-", f"{device_name(device)}-torch{torch.__version__}").strip("-")
    return Path(models_dir) / COMPILE_CACHE / key


def host_cache_dir(models_dir: Path) -> Path:
    """The folder of built artifacts for `models_dir` that no device shapes (the text tokenizer)."""
    return Path(models_dir) / COMPILE_CACHE / "host"


def keep_compiled_artifacts(directory: Path) -> Path | None:
    """Point Inductor's cache and Triton's (`directory`/triton) at `directory`, created if needed, unless
    the environment already names them. Returns Inductor's folder in use, or None when `directory`
    cannot be written (both then keep their defaults)."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        directory = Path(chosen)
    else:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("compile cache %s not writable (%s); compiling into the default cache", directory,
                           exc.strerror)
            return None
        # Inductor reads the variable whenever it looks for its cache: set before the first compilation.
        os.environ[CACHE_ENV] = str(directory)
    # Inductor points Triton inside its own cache only once it builds an autotuner, which a restart that
    # finds its graphs cached may never do: Triton kernels compiled before that (the LLM's decode
    # attention) then went to ~/.triton and compiled again at every start in a fresh container (6.7 s
    # of an H100 restart, docs/benchmarks.md). Named here, every Triton kernel of the process shares it.
    os.environ.setdefault(TRITON_CACHE_ENV, str(directory / "triton"))
    return directory
