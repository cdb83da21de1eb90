"""Pick the token2wav backend: TensorRT when it can run here, PyTorch otherwise, and say which and why.

Importing this module is cheap (the service's configuration names `Token2WavBackend`); the backends
and their libraries are imported when one is selected.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from engines.token2wav.base import Token2Wav
    from engines.token2wav.dit_cache import CacheRule
    from engines.token2wav.torch_backend import FlowVariant
    from engines.token2wav.trt_pool import Precision

logger = logging.getLogger(__name__)

Token2WavBackend = Literal["auto", "tensorrt", "torch"]


def tensorrt_unavailable(
    models_dir: Path, flow: FlowVariant, device: str, precision: Precision
) -> str | None:
    """Why the TensorRT backend cannot serve `models_dir` here, or None when it can."""
    import torch

    from engines.token2wav.trt_pool import TrtArtifacts

    if flow != "dit":
        return f"TensorRT plans exist for the DiT flow only, not {flow!r}"
    if torch.device(device).type != "cuda":
        return f"TensorRT needs a CUDA device, not {device!r}"
    plan = TrtArtifacts(Path(models_dir)).dit_chunk_plan(precision)
    if not plan.is_file():
        return f"{plan} is missing (build_engines.py export-onnx, then build-trt)"
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt package is not installed"
    return None


def select_token2wav(
    models_dir: Path,
    backend: Token2WavBackend = "auto",
    flow: FlowVariant = "dit",
    device: str = "cuda",
    precision: Precision = "fp16",
    pool_size: int = 4,
    torch_dtype: torch.dtype | None = None,
    cuda_graphs: bool = True,
    dit_cache_rule: CacheRule = "reference",
    solve_memory_bytes: int | None = None,
    final_chunk_graphs: bool = True,
    precompiled: Path | None = None,
    preload_compile_workers: bool = True,
    vocoder_dtype: torch.dtype | None = None,
    graph_hops: Sequence[int] | None = None,
    extra_first_hops: Sequence[int] = (),
) -> Token2Wav:
    """The token2wav backend for `models_dir`: `tensorrt` or `torch` as asked, `auto` prefers TensorRT.

    torch_dtype: the PyTorch flow's dtype (None: the backend's default, fp16 on CUDA).
    cuda_graphs: let the PyTorch backend run the DiT solver and HiFT from CUDA graphs. Graphs replay
        from shared static buffers, so a backend called from several threads at once runs without them.
    dit_cache_rule: the DiT flow's streaming estimator-cache rule (dit_cache.py; "reference" default).
    solve_memory_bytes: the PyTorch DiT flow's cap on one batched solve (solve_memory.py; None: none).
    final_chunk_graphs: the PyTorch backend's HiFT graphs for final chunks of any length (TorchToken2Wav).
    precompiled: where the PyTorch backend keeps its ahead-of-time compiled DiT block (TorchToken2Wav).
    preload_compile_workers: as for `TorchToken2Wav.from_models_dir`.
    vocoder_dtype: HiFT's decoder's, in either backend (`HiFTGenerator.use_decoder_dtype`; None: float32,
        as the reference).
    graph_hops: the chunk lengths (speech tokens) whose CUDA graphs the PyTorch backend captures at
        start-up (None: its `GRAPH_HOPS`, the exponential schedule's 15, 25, 50, 100).
    extra_first_hops: other first-chunk lengths streams may start with (their first chunks' graphs too).
    Asking for `tensorrt` where it cannot run raises RuntimeError with the reason.
    """
    import torch  # both backends run on it; this module is imported without it

    decoder_dtype = torch.float32 if vocoder_dtype is None else vocoder_dtype
    reason = None if backend == "torch" else tensorrt_unavailable(models_dir, flow, device, precision)
    if backend == "tensorrt" and reason is not None:
        raise RuntimeError(f"the TensorRT token2wav backend cannot run: {reason}")
    if backend != "torch" and reason is None:
        from engines.token2wav.trt_pool import load_trt_token2wav

        logger.info("token2wav backend: TensorRT (%s plans, %d contexts)", precision, pool_size)
        return load_trt_token2wav(models_dir, precision, pool_size, device, dit_cache_rule, decoder_dtype)
    from engines.token2wav.torch_backend import GRAPH_HOPS, TorchToken2Wav

    logger.info("token2wav backend: PyTorch %s flow (%s)", flow, reason or "requested")
    return TorchToken2Wav.from_models_dir(models_dir, flow, device, torch_dtype, cuda_graphs, dit_cache_rule,
                                          solve_memory_bytes, final_chunk_graphs, precompiled,
                                          preload_compile_workers, decoder_dtype,
                                          GRAPH_HOPS if graph_hops is None else graph_hops, extra_first_hops)
