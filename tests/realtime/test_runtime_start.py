"""A start that fails part-way ends what it began (realtime/runtime.py, realtime/tasks.py): the service's
own process exits then, but an embedding application lives on and must not keep the threads, engines
and compile processes of a runtime it never got. An LLM engine with a fixed cache builds while token2wav
loads."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from engines.llm.base import LLMEngine
from engines.llm.torch_engine import TorchLLMEngine
from engines.token2wav.torch_backend import TorchToken2Wav
from realtime.config import ServiceConfig
from realtime.engine_loader import LLMsChosen, LoadedEngines, load_engines
from realtime.runtime import Runtime
from realtime.tasks import together


def slow_llm_builds(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """PyTorch LLM engines build 1 s slower from now on; when each build ended (time.monotonic)."""
    built: list[float] = []
    build = TorchLLMEngine._build_runner

    def slow_build(engine: TorchLLMEngine) -> Any:
        time.sleep(1.0)
        runner = build(engine)
        built.append(time.monotonic())
        return runner

    monkeypatch.setattr(TorchLLMEngine, "_build_runner", slow_build)
    return built


def engine_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name.startswith(("token2wav", "llm-engine"))}


def engine_threads_left(before: set[threading.Thread]) -> set[threading.Thread]:
    """Engine threads running now that were not running `before`."""
    return {thread for thread in engine_threads() - before if thread.is_alive()}


async def test_a_start_that_fails_stops_its_workers_and_engines(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The voices fail to load while the LLM engine still builds beside them (slowed here): the start
    raises that error only once the build has ended (a thread cannot be stopped: its engine thread must
    never start afterwards), and then no token2wav or LLM thread of it runs and each token2wav backend
    was closed (its idle compile processes end). The runtime cannot be started again."""
    closed: list[str] = []
    monkeypatch.setattr(TorchToken2Wav, "close", lambda backend: closed.append(str(backend.device)))
    built = slow_llm_builds(monkeypatch)

    async def unreadable(runtime: Runtime) -> bool:
        raise RuntimeError("the voices folder is unreadable")

    monkeypatch.setattr(Runtime, "_prepare_voices", unreadable)
    before = engine_threads()
    runtime = Runtime(ServiceConfig(models_dir=tiny_models, device="cpu", max_streams=2,
                                    token2wav_devices=("cpu", "cpu")))
    with pytest.raises(RuntimeError, match="voices folder is unreadable"):
        await runtime.start()
    raised = time.monotonic()
    assert len(built) == 1 and built[0] <= raised
    await asyncio.sleep(0.2)
    assert engine_threads_left(before) == set()
    assert closed == ["cpu", "cpu"]
    with pytest.raises(RuntimeError, match="starts once"):
        await runtime.start()


async def test_together_cancels_and_awaits_the_others_when_one_fails(
    caplog: pytest.LogCaptureFixture
) -> None:
    """The first failure propagates as itself (not a group) once the siblings have ended; a sibling that
    failed too is logged; with no failure the results come in order."""
    ended: list[str] = []

    async def slow(name: str) -> str:
        try:
            await asyncio.sleep(10)
        finally:
            ended.append(name)
        return name

    async def fails(message: str, after: float = 0.0) -> None:
        await asyncio.sleep(after)
        raise ValueError(message)

    with pytest.raises(ValueError, match="first"):
        await together(slow("a"), fails("first"), slow("b"))
    assert sorted(ended) == ["a", "b"]
    with caplog.at_level(logging.ERROR, logger="realtime.tasks"), pytest.raises(ValueError, match="one"):
        await together(fails("one"), fails("two"))
    assert [record.getMessage() for record in caplog.records] == ["also failed: ValueError"]

    async def value(number: int) -> int:
        return number

    assert await together(value(1), value(2)) == [1, 2]


def loader_waiting_for_the_llm(started: threading.Event, fail: bool = False) -> Any:
    """`load_engines` whose token2wav part waits until the LLM engine has started (so a start that only
    began building the LLM after loading would never get there), then fails if `fail`."""
    def load(config: ServiceConfig, on_llms: LLMsChosen | None = None) -> LoadedEngines:
        def chosen(llms: tuple[LLMEngine, ...]) -> None:
            for llm in llms:
                start = llm.start

                async def recorded(start: Any = start) -> None:
                    await start()
                    started.set()

                llm.start = recorded  # type: ignore[method-assign]
            assert on_llms is not None
            on_llms(llms)
            assert started.wait(timeout=120), "the LLM engine did not build while token2wav loaded"
            if fail:
                raise RuntimeError("the token2wav weights are unreadable")

        return load_engines(config, chosen)

    return load


async def test_the_llm_engine_builds_while_token2wav_loads(tiny_models: Path) -> None:
    started = threading.Event()
    runtime = Runtime(ServiceConfig(models_dir=tiny_models, device="cpu", max_streams=2),
                      loader=loader_waiting_for_the_llm(started))
    try:
        await runtime.start()
        assert runtime.ready and started.is_set()
    finally:
        await runtime.stop(drain_timeout_s=0.0)


async def test_a_load_that_fails_stops_the_llm_engine_it_began_building(tiny_models: Path) -> None:
    before = engine_threads()
    runtime = Runtime(ServiceConfig(models_dir=tiny_models, device="cpu", max_streams=2),
                      loader=loader_waiting_for_the_llm(threading.Event(), fail=True))
    with pytest.raises(RuntimeError, match="weights are unreadable"):
        await runtime.start()
    await asyncio.sleep(0.2)
    assert engine_threads_left(before) == set()


async def test_a_start_failing_before_it_waits_for_the_llm_build_still_ends_it(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LLM engine builds from the loader's hand-over on; the start then fails before it waits for that
    build (here: setting up the GPU memory metrics). The failed start waits for the build to end and stops
    what it started: no LLM engine thread starts after the start has raised."""
    import realtime.runtime as runtime_module

    built = slow_llm_builds(monkeypatch)

    def broken(*args: object) -> None:
        raise RuntimeError("the metrics could not be set up")

    monkeypatch.setattr(runtime_module, "track_gpu_memory", broken)
    before = engine_threads()
    runtime = Runtime(ServiceConfig(models_dir=tiny_models, device="cpu", max_streams=2))
    with pytest.raises(RuntimeError, match="metrics could not be set up"):
        await runtime.start()
    raised = time.monotonic()
    assert len(built) == 1 and built[0] <= raised
    await asyncio.sleep(1.5)
    assert engine_threads_left(before) == set()


async def test_ending_a_build_waits_for_it_then_raises_the_callers_cancellation(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LLMBuild.end` while the engine still builds: the build thread is waited for and what it made
    discarded, no engine thread runs after; a cancellation of `end`'s caller meanwhile is raised then, not
    swallowed (a stop under a timeout must still time out)."""
    from engines.llm.auto import select_llm
    from realtime.llm_build import LLMBuild

    slow_llm_builds(monkeypatch)
    before = engine_threads()
    llm = select_llm(tiny_models, "torch", "cpu", max_slots=1)
    starting = LLMBuild(asyncio.get_running_loop())
    starting.begin([llm])
    ending = asyncio.ensure_future(starting.end())
    await asyncio.sleep(0.2)
    ending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ending
    await asyncio.sleep(0.2)
    assert engine_threads_left(before) == set()
    assert starting.begin([llm]) is not None and starting.begin([llm]).cancelled()  # type: ignore[union-attr]


async def test_a_failed_build_is_reported_once(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A build that fails reaches the start through `wait`, which raises it; `end` then stops the engines
    without logging the same failure again. One nobody waited for is logged by `end`."""
    from engines.llm.auto import select_llm
    from realtime.llm_build import LLMBuild

    def broken(engine: TorchLLMEngine) -> Any:
        raise RuntimeError("no room for the KV cache")

    monkeypatch.setattr(TorchLLMEngine, "_build_runner", broken)
    for waited in (True, False):
        caplog.clear()
        starting = LLMBuild(asyncio.get_running_loop())
        llm = select_llm(tiny_models, "torch", "cpu", max_slots=1)
        if waited:
            with pytest.raises(RuntimeError, match="no room"):
                await starting.wait([llm])
        else:
            building = starting.begin([llm])
            assert building is not None
            await asyncio.wait([building])
        with caplog.at_level(logging.ERROR, logger="realtime.llm_build"):
            await starting.end()
        logged = [r for r in caplog.records if "start failed" in r.getMessage()]
        assert len(logged) == (0 if waited else 1)


async def test_the_memory_budget_is_read_off_the_event_loop(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admission's reading of free device memory at the end of the start empties the allocator's cache,
    which waits for a warm-up step's CUDA graph capture under way: it runs in a thread, not on the loop."""
    import realtime.runtime as runtime_module

    read_on: list[int] = []

    def budgets(devices: list[Any], configured: int | None, margin: int) -> list[int | None]:
        read_on.append(threading.get_ident())
        return [None] * len(devices)

    monkeypatch.setattr(runtime_module, "device_budgets", budgets)
    runtime = Runtime(ServiceConfig(models_dir=tiny_models, device="cpu", max_streams=2))
    await runtime.start()
    try:
        assert read_on and read_on[0] != threading.get_ident()
    finally:
        await runtime.stop(drain_timeout_s=0.0)
