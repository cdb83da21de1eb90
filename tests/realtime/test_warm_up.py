"""realtime/warm_up.py: the batch sizes a token2wav worker warms up, and where a cold start's compiling runs
beside the LLM's build."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engines.llm.torch_engine import TorchLLMEngine
from engines.llm.trtllm import TrtLlmEngine
from realtime.config import ServiceConfig
from realtime.runtime import Runtime
from realtime.warm_up import (
    COMPILE_BESIDE_LLM_MIN_FREE_BYTES,
    compile_beside_llm,
    preload_compile_workers,
    prepare_warmups,
    warmup_batches,
)

ROOM = COMPILE_BESIDE_LLM_MIN_FREE_BYTES


def test_warm_up_stops_at_the_bucket_of_the_most_rows_a_worker_can_meet() -> None:
    assert warmup_batches(64, 160) == [1, 2, 4, 8, 16, 32, 64]
    assert warmup_batches(64, 16) == [1, 2, 4, 8, 16]  # 16 streams never make a batch of 17
    assert warmup_batches(32, 20) == [1, 2, 4, 8, 16, 32]  # 20 rows run in the 32-row bucket
    assert warmup_batches(1, 8) == [1]


class LLM:
    """An LLM engine as the policy sees it: its name and how it sizes its cache."""

    def __init__(self, name: str, sizes_cache_by_free_memory: bool) -> None:
        self.name, self.sizes_cache_by_free_memory = name, sizes_cache_by_free_memory


TORCH, TRT = LLM("torch", False), LLM("tensorrt_llm", True)


def test_the_engines_say_how_they_size_their_cache() -> None:
    """TensorRT-LLM's executor takes a fraction of the free memory for its KV cache; ours has a fixed one."""
    assert TrtLlmEngine.sizes_cache_by_free_memory
    assert not TorchLLMEngine.sizes_cache_by_free_memory


def test_compiling_runs_beside_the_llm_build_only_where_it_cannot_starve_it(
    caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU the LLM does not use always compiles early; a shared one only with room for every token2wav
    worker on it and no LLM sizing its cache by the free memory. The GPUs left out are logged."""
    with caplog.at_level(logging.INFO, logger="realtime.warm_up"):
        assert compile_beside_llm([TORCH], ["cuda"], {"cuda": ROOM}) == {0}  # worker 0, on `cuda:0`
        assert compile_beside_llm([TORCH], ["cuda:0"], {"cuda:0": ROOM - 1}) == set()
        # Two token2wav workers on the shared GPU: twice the room; the GPU of its own is early anyway.
        assert compile_beside_llm([TORCH], ["cuda:0", "cuda:0", "cuda:1"], {"cuda:0": 2 * ROOM - 1}) == {2}
        assert compile_beside_llm([TORCH], ["cuda:0", "cuda:0", "cuda:1"], {"cuda:0": 2 * ROOM}) == {0, 1, 2}
        assert compile_beside_llm([TORCH, TRT], ["cuda:0", "cuda:1"], {"cuda:0": 8 * ROOM}) == {1}
        assert compile_beside_llm([TORCH], ["cuda:1"], {}) == {0}  # nothing shared
    said = [record.getMessage() for record in caplog.records]
    assert said == [
        "cuda:0: a cold start's compile workers start after the LLM build (40.0 GiB free before the LLM "
        "builds, 40 GiB wanted)",
        "cuda:0: a cold start's compile workers start after the LLM build (80.0 GiB free before the LLM "
        "builds, 80 GiB wanted)",
        "cuda:0: a cold start's compile workers start after the LLM build (the tensorrt_llm LLM engine sizes "
        "its cache by the free memory)",
    ]


async def test_the_runtime_hands_the_early_start_to_the_workers_it_names(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prepare_warmups` gives the default voice and warm-up batches of the runtime's plans to exactly the
    token2wav workers the policy named, by index (the plan named a GPU `cuda` where its worker's device
    was `cuda:0`, and no worker was ever picked)."""
    runtime = Runtime(ServiceConfig(models_dir=tiny_models, device="cpu", max_streams=2,
                                    token2wav_devices=("cpu", "cpu")))
    await runtime.start()
    try:
        called: list[tuple[int, list[int]]] = []
        for index, worker in enumerate(runtime._workers):
            async def record(speaker: object, batches: list[int], index: int = index) -> None:
                called.append((index, list(batches)))

            monkeypatch.setattr(worker, "prepare_warmup", record)
        plans = runtime._warmup_plans()
        await prepare_warmups(plans, {1})
        assert called == [(1, plans[1][2])]
        called.clear()
        await prepare_warmups(plans, set())
        assert called == []
    finally:
        await runtime.stop(drain_timeout_s=1.0)


def test_compile_workers_take_device_memory_early_only_beside_an_llm_with_a_fixed_cache() -> None:
    """A cold start's compile workers build their models on the GPU while the engines load unless an LLM
    engine on that GPU sizes its cache by the free memory then (it would keep the smaller cache), or the
    GPU is too small to hold them through the LLM's build (the room compiling beside the LLM wants, per
    token2wav worker on it)."""
    big = 80 << 30
    assert preload_compile_workers([TORCH], ["cuda:0"], ["cuda:0"], 0, big)
    assert not preload_compile_workers([TRT], ["cuda:0"], ["cuda:0"], 0, big)
    assert preload_compile_workers([TRT], ["cuda:0"], ["cuda:0", "cuda:1"], 1, big)  # its own GPU
    assert not preload_compile_workers([TORCH, TRT], ["cuda:1", "cuda:0"], ["cuda:0"], 0, big)
    assert not preload_compile_workers([TORCH], ["cuda:0"], ["cuda:0"], 0, ROOM - 1)  # a 24 GB card, say
    assert not preload_compile_workers([TORCH], ["cuda:0"], ["cuda:0", "cuda:0"], 0, 2 * ROOM - 1)
    assert preload_compile_workers([TORCH], ["cuda:0"], ["cuda:0", "cuda:0"], 1, 2 * ROOM)


async def test_a_start_without_a_warm_up_releases_what_was_prepared_for_one(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No warm-up comes (CPU workers here; on a GPU, no default voice): each token2wav worker's backend
    is told so (`Token2Wav.release_warmup`: a cold start's idle compile processes end then, not at their
    30-minute idle timeout)."""
    from engines.token2wav.torch_backend import TorchToken2Wav

    released: list[str] = []

    def record(backend: TorchToken2Wav) -> None:
        released.append(str(backend.device))

    monkeypatch.setattr(TorchToken2Wav, "release_warmup", record)
    runtime = Runtime(ServiceConfig(models_dir=tiny_models, device="cpu", max_streams=2,
                                    token2wav_devices=("cpu", "cpu")))
    await runtime.start()
    try:
        assert released == ["cpu", "cpu"]
    finally:
        await runtime.stop(drain_timeout_s=1.0)
