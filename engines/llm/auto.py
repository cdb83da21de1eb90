"""Pick the LLM engine: TensorRT-LLM when it can run here, PyTorch otherwise, and say which and why.

Importing this module is cheap (the service's configuration names `LLMBackend`); the engines and
their libraries are imported when one is selected.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, Literal

from engines.config import ModelPaths
from engines.llm.base import LLMEngine

logger = logging.getLogger(__name__)

LLMBackend = Literal["auto", "tensorrt_llm", "torch"]


def tensorrt_llm_unavailable(models_dir: Path, device: str) -> str | None:
    """Why the TensorRT-LLM engine cannot serve `models_dir` here, or None when it can."""
    import torch

    from engines.llm.hf_export import is_exported
    from engines.llm.trtllm import engine_dir

    if torch.device(device).type != "cuda":
        return f"TensorRT-LLM needs a CUDA device, not {device!r}"
    hf_dir, engine = ModelPaths(Path(models_dir)).hf_llm, engine_dir(models_dir)
    if not is_exported(hf_dir):
        return f"{hf_dir} is not a complete export (build_engines.py convert-hf)"
    if not (engine / "config.json").is_file():
        return f"{engine} holds no engine (build_engines.py build-trtllm)"
    if importlib.util.find_spec("tensorrt_llm") is None:
        return "the tensorrt_llm package is not installed"
    return None


def select_llm(
    models_dir: Path, backend: LLMBackend = "auto", device: str = "cuda", **torch_options: Any
) -> LLMEngine:
    """The LLM engine for `models_dir`: `tensorrt_llm` or `torch` as asked, `auto` prefers TensorRT-LLM.

    `torch_options` are `TorchLLMConfig` fields. Asking for `tensorrt_llm` where it cannot run raises
    RuntimeError with the reason.
    """
    reason = None if backend == "torch" else tensorrt_llm_unavailable(models_dir, device)
    if backend == "tensorrt_llm" and reason is not None:
        raise RuntimeError(f"the TensorRT-LLM engine cannot run: {reason}")
    if backend != "torch" and reason is None:
        from engines.llm.trtllm import TrtLlmEngine, engine_dir

        logger.info("LLM engine: TensorRT-LLM (%s)", engine_dir(models_dir))
        return TrtLlmEngine.from_models_dir(models_dir)
    from engines.llm.torch_engine import TorchLLMEngine

    logger.info("LLM engine: PyTorch (%s)", reason or "requested")
    return TorchLLMEngine.from_models_dir(models_dir, device=device, **torch_options)
