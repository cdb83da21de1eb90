"""Start-up policy: which batch sizes a token2wav worker warms up, and whether a cold start's compiling
may run beside the LLM engines' build on the GPUs they share (realtime/runtime.py carries it out)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engines.llm.base import LLMEngine

# Device memory a shared GPU must have free, once the engines are loaded, for a cold start's compile
# workers to run while the LLM builds: six processes with a CUDA context, the DiT and one Euler step's
# activations each take a few GiB together, which on a smaller card could leave the LLM's build short.
COMPILE_BESIDE_LLM_MIN_FREE_BYTES = 40 << 30


def warmup_batches(max_batch: int, max_rows: int) -> list[int]:
    """The batch sizes (powers of two: the row buckets) a warm-up runs for a token2wav worker that runs
    at most `max_batch` chunks per call and serves at most `max_rows` streams at once. A stream has at
    most one chunk in flight, so no call has more rows than streams: warming larger buckets would only
    take GPU memory (under the reference DiT cache rule the 64-row graphs alone exhaust an 80 GB H100
    at 128 streams, docs/benchmarks.md)."""
    rows = max(1, min(max_batch, max_rows))
    top = 1 << (rows - 1).bit_length()  # the bucket that holds `rows`
    return [1 << i for i in range(top.bit_length())]


def compile_beside_llm(llms: Sequence[LLMEngine], free_bytes: Iterable[int]) -> bool:
    """Whether the token2wav warm-up's work in other processes (a cold start's compile workers,
    `Token2Wav.prepare_warmup`) may start before the LLM engines build on the GPUs they share, whose
    free memory is `free_bytes`: not when an LLM sizes its cache by the free memory (TensorRT-LLM's
    executor: the workers would shrink it), nor when a GPU has less than
    `COMPILE_BESIDE_LLM_MIN_FREE_BYTES` free."""
    if any(llm.sizes_cache_by_free_memory for llm in llms):
        return False
    return all(free >= COMPILE_BESIDE_LLM_MIN_FREE_BYTES for free in free_bytes)
