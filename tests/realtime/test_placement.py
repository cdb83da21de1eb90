"""Several token2wav workers in one process (one per GPU in production; here several on the CPU, with
the real tiny engines): where streams go, that a stream's chunks stay on its worker, and what a full
or dead worker does to new streams."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx
import pytest
from testing import serve, service_config, speak_samples

from engines.llm.base import SamplingParams
from engines.token2wav.base import ChunkJob, LaunchedChunks
from engines.token2wav.torch_backend import TorchToken2Wav
from realtime.cli import _config, build_parser
from realtime.placement import (
    DevicePlan,
    PlacementKind,
    WorkerLoad,
    least_loaded,
    parse_devices,
    plan_devices,
    split_capacity,
)
from realtime.session import ServiceError, Session, SpeechRequest

TOKENS = 70  # three chunks under the exponential schedule


class WorkerCrash(BaseException):
    """What a fatal fault looks like to a worker thread: not an Exception a batch can survive."""


def test_least_loaded_prefers_the_emptiest_live_worker_with_room() -> None:
    assert least_loaded([WorkerLoad(1, 2), WorkerLoad(0, 2)]) == 1
    assert least_loaded([WorkerLoad(0, 2), WorkerLoad(0, 2)]) == 0  # ties: the first
    assert least_loaded([WorkerLoad(2, 4), WorkerLoad(1, 1)]) == 0  # a share, not a count
    assert least_loaded([WorkerLoad(0, 2, alive=False), WorkerLoad(1, 2)]) == 1
    assert least_loaded([WorkerLoad(2, 2), WorkerLoad(0, 2, alive=False)]) is None
    assert least_loaded([]) is None


def test_capacity_is_shared_out_evenly() -> None:
    assert split_capacity(16, 1) == [16]
    assert split_capacity(10, 4) == [3, 3, 2, 2]
    assert split_capacity(1, 2) == [1, 1]  # every worker takes at least one stream


def test_device_plans() -> None:
    two = plan_devices("auto", 2)
    assert two == DevicePlan(("cuda:0",), ("cuda:0", "cuda:1"))
    assert two.llm_for(0) == 0 and two.llm_for(1) is None
    replicated = plan_devices("auto", 4, PlacementKind.REPLICATED)
    assert replicated.llm_devices == replicated.token2wav_devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert replicated.llm_for(2) == 2
    assert plan_devices("auto", 0) == DevicePlan(("cpu",), ("cpu",))
    assert plan_devices("cuda:1", 4) == DevicePlan(("cuda:1",), ("cuda:1",))
    explicit = plan_devices("auto", 4, llm_devices=("cuda:0",), token2wav_devices=("cuda:1", "cuda:2"))
    assert explicit == DevicePlan(("cuda:0",), ("cuda:1", "cuda:2"))
    assert parse_devices("cuda:1, 2") == ("cuda:1", "cuda:2")
    with pytest.raises(ValueError, match="no device"):
        parse_devices(" , ")
    with pytest.raises(ValueError, match="empty"):
        DevicePlan((), ("cpu",))


def test_shared_gpus_are_those_holding_both_engines() -> None:
    """On such a GPU the engines build one after the other at start-up (realtime/runtime.py)."""
    assert plan_devices("auto", 2).shared_gpus == ("cuda:0",)
    assert plan_devices("auto", 4, PlacementKind.REPLICATED).shared_gpus == ("cuda:0", "cuda:1", "cuda:2",
                                                                              "cuda:3")
    assert plan_devices("auto", 4, llm_devices=("cuda:0",), token2wav_devices=("cuda:1",)).shared_gpus == ()
    assert plan_devices("auto", 0).shared_gpus == ()  # the CPU is not a GPU


def test_cli_placement_flags(tiny_models: Path) -> None:
    args = build_parser().parse_args([
        "serve", "--models", str(tiny_models), "--llm-device", "cuda:0",
        "--token2wav-devices", "cuda:1,cuda:2", "--placement", "replicated",
    ])
    config = _config(args)
    assert config.llm_devices == ("cuda:0",)
    assert config.token2wav_devices == ("cuda:1", "cuda:2")
    assert config.placement is PlacementKind.REPLICATED
    assert config.device_plan == DevicePlan(("cuda:0",), ("cuda:1", "cuda:2"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--token2wav-devices", ","])


def _worker_samples(metrics: str, name: str) -> dict[str, float]:
    """`{worker index: value}` of one of the per-worker gauges."""
    values = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].split("} ")
            worker = dict(part.split("=") for part in labels.split(","))["worker"].strip('"')
            values[worker] = float(value)
    return values


async def test_streams_spread_over_workers_stay_on_theirs_and_a_dead_worker_takes_none(
    tiny_models: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    eventually: Callable[[Callable[[], bool]], Awaitable[None]],
) -> None:
    threads_of: dict[int, set[str]] = {}
    crash_on: set[str] = set()  # worker thread names whose next batch dies
    launch_chunks = TorchToken2Wav.launch_chunks

    def recording(self: TorchToken2Wav, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        name = threading.current_thread().name
        if name in crash_on:
            raise WorkerCrash()
        for job in jobs:
            threads_of.setdefault(id(job.stream), set()).add(name)
        return launch_chunks(self, jobs)

    monkeypatch.setattr(TorchToken2Wav, "launch_chunks", recording)
    config = service_config(tiny_models, tmp_path, device="cpu", token2wav_devices=("cpu", "cpu"),
                            max_streams=4)
    async with serve(config) as server, httpx.AsyncClient(base_url=server.http_url) as client:
        runtime = server.runtime
        # Four streams at once: two on each worker (capacity 2 each), each run by its worker's thread.
        await asyncio.gather(*(speak_samples(runtime, seed, TOKENS) for seed in range(4)))
        assert len(threads_of) == 4 and all(len(names) == 1 for names in threads_of.values())
        placed = sorted(next(iter(names)) for names in threads_of.values())
        assert placed == ["token2wav0-0", "token2wav0-0", "token2wav1-0", "token2wav1-0"]
        metrics = (await client.get("/metrics")).text
        assert _worker_samples(metrics, "tts_token2wav_worker_capacity") == {"0": 2.0, "1": 2.0}
        assert _worker_samples(metrics, "tts_token2wav_worker_streams") == {"0": 0.0, "1": 0.0}
        assert "tts_stream_capacity_free 4.0" in metrics
        assert "tts_stream_capacity_used_ratio 0.0" in metrics

        # Worker 1's thread dies in the middle of a stream: that stream fails with a clear error
        # instead of hanging, and the worker takes no new streams.
        crash_on.add("token2wav1-0")
        first = runtime.speak(SpeechRequest("Hello.", sampling=SamplingParams(seed=1, fixed_length=TOKENS)))
        second = runtime.speak(SpeechRequest("Hello.", sampling=SamplingParams(seed=2, fixed_length=TOKENS)))
        outcomes = await asyncio.gather(*(_drain(session) for session in (first, second)))
        assert sorted(outcomes, key=str) == ["internal_error", "ok"]
        metrics = (await client.get("/metrics")).text
        assert _worker_samples(metrics, "tts_token2wav_worker_alive") == {"0": 1.0, "1": 0.0}
        assert "tts_stream_capacity_free 2.0" in metrics
        assert "tts_stream_capacity_used_ratio 0.0" in metrics  # of the live worker's capacity

        # Only worker 0's two slots are left: a third stream is refused although the process-wide
        # limit (4) would admit it.
        threads_of.clear()
        held = [runtime.speak(SpeechRequest("Hello.", sampling=SamplingParams(seed=s, fixed_length=TOKENS)))
                for s in (3, 4)]
        with pytest.raises(ServiceError) as refused:
            runtime.speak(SpeechRequest("Hello."))
        assert (refused.value.code, refused.value.http_status) == ("busy", 429)
        assert await asyncio.gather(*(_drain(session) for session in held)) == ["ok", "ok"]
        assert set().union(*threads_of.values()) == {"token2wav0-0"}
        await eventually(lambda: runtime.stats().active_streams == 0)


async def _drain(session: Session) -> str:
    """'ok' once the session has delivered all its audio, else the code of the error it ended with."""
    try:
        async with session:
            async for _ in session:
                pass
    except ServiceError as exc:
        return exc.code
    return "ok"


def test_a_bare_cuda_and_cuda_0_are_one_gpu() -> None:
    """`--device cuda` with `--token2wav-devices cuda:0` shares one GPU: the start-up then builds the two
    sides one after the other (building them at once once ran an 80 GB H100 out of memory)."""
    plan = plan_devices("cuda", 1, token2wav_devices=("cuda:0",))
    assert plan.llm_devices == ("cuda:0",) and plan.shared_gpus == ("cuda:0",)
    assert plan.llm_for(0) == 0
    assert plan_devices("cpu", 0).llm_devices == ("cpu",)
