"""Start-up policy: which batch sizes a token2wav worker warms up, and on which GPUs a cold start's
compiling may run while the LLM engines build (realtime/runtime.py carries it out)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

from engines.llm.base import LLMEngine
from engines.token2wav.base import SpeakerState
from realtime.token2wav_worker import Token2WavWorker

logger = logging.getLogger(__name__)

# Device memory a GPU shared with the LLM must have free before the LLM builds, per token2wav worker on
# it, for that worker's cold-start compile processes to run during the build: they hold a CUDA context,
# the DiT and one Euler step's activations each (up to twelve of them: ~1 GiB each and the activations
# of a 64-row step), and the LLM's cache and graphs must still fit beside them.
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


def compile_beside_llm(llms: Sequence[LLMEngine], token2wav_devices: Sequence[str],
                       free_bytes: Mapping[str, int]) -> set[int]:
    """The token2wav workers (indices into `token2wav_devices`, as the plan names their devices) whose
    warm-up work in other processes (a cold start's compile workers, `Token2Wav.prepare_warmup`) may
    start before the LLM engines build. Indices, not devices: a worker's torch device (`cuda:0`) need
    not equal the plan's name for it (`cuda`). `free_bytes`: the free memory of
    each GPU the LLM shares with token2wav, measured before the LLM builds. A device the LLM does not
    use, always; a shared one only if no LLM sizes its cache by the free memory (TensorRT-LLM's
    executor: the workers would shrink it) and it has `COMPILE_BESIDE_LLM_MIN_FREE_BYTES` free per
    token2wav worker on it. The shared ones left out are logged (what a cold start would then wait for)."""
    sizes_by_free = [llm.name for llm in llms if llm.sizes_cache_by_free_memory]
    early: set[int] = set()
    for device in dict.fromkeys(token2wav_devices):
        free = free_bytes.get(device)
        wanted = token2wav_devices.count(device) * COMPILE_BESIDE_LLM_MIN_FREE_BYTES
        if free is None or (not sizes_by_free and free >= wanted):
            early.update(index for index, name in enumerate(token2wav_devices) if name == device)
            continue
        reason = (f"the {sizes_by_free[0]} LLM engine sizes its cache by the free memory" if sizes_by_free
                  else f"{free / 2**30:.1f} GiB free before the LLM builds, {wanted / 2**30:.0f} GiB wanted")
        logger.info("%s: a cold start's compile workers start after the LLM build (%s)", device, reason)
    return early


def preload_compile_workers(llms: Sequence[LLMEngine], llm_devices: Sequence[str],
                            token2wav_devices: Sequence[str], index: int, total_bytes: int) -> bool:
    """Whether the cold-start compile workers of token2wav worker `index` (on `token2wav_devices[index]`,
    a GPU of `total_bytes`) may build their models on the GPU while the engines load, before any LLM
    builds (block_compile.py): not where an LLM engine on that GPU sizes its cache by the free memory
    (TensorRT-LLM's executor: the workers' contexts and models would shrink it for good), nor on a GPU
    without `COMPILE_BESIDE_LLM_MIN_FREE_BYTES` in all per token2wav worker on it (their ~1 GiB each
    would stay held through the LLM's build there). Devices as the plan names them."""
    device = token2wav_devices[index]
    if total_bytes < token2wav_devices.count(device) * COMPILE_BESIDE_LLM_MIN_FREE_BYTES:
        return False
    return not any(llm.sizes_cache_by_free_memory and llm_device == device
                   for llm, llm_device in zip(llms, llm_devices, strict=True))


WarmupPlan = tuple[Token2WavWorker, SpeakerState, list[int]]  # a worker, its voice, its batch sizes


async def prepare_warmups(plans: Sequence[WarmupPlan], indices: set[int]) -> None:
    """Let the token2wav workers at `indices` of `plans` start what their warm-up has other processes do
    meanwhile (`Token2Wav.prepare_warmup`: a cold start's compiling)."""
    await asyncio.gather(*(worker.prepare_warmup(speaker, batches)
                           for index, (worker, speaker, batches) in enumerate(plans) if index in indices))


async def warm_up(plans: Sequence[WarmupPlan], between_calls: bool) -> None:
    """Run the schedule's chunk shapes at the planned batch sizes (`warmup_batches`) on every CUDA token2wav
    worker at once (each has its own thread and GPU), so that the first requests do not pay for CUDA-graph
    capture or compilation; `between_calls`: the warm-up's first stage only, the rest runs between calls
    (`Token2WavWorker.warmup`)."""
    started = time.perf_counter()
    await asyncio.gather(*(worker.warmup(speaker, batches, between_calls)
                           for worker, speaker, batches in plans if worker.device.type == "cuda"))
    rest = " (first stage; the rest between calls)" if between_calls else ""
    largest = max((batches for _, _, batches in plans), key=len)
    seconds = time.perf_counter() - started
    logger.info("token2wav warmed up for batches %s in %.1f s%s", largest, seconds, rest)
