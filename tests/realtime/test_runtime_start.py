"""A start that fails part-way ends what it began (realtime/runtime.py): the service's own process exits
then, but an embedding application lives on and must not keep the threads, engines and compile
processes of a runtime it never got."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from engines.token2wav.torch_backend import TorchToken2Wav
from realtime.config import ServiceConfig
from realtime.runtime import Runtime


def engine_threads() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate()
                  if thread.name.startswith(("token2wav", "llm-engine")))


async def test_a_start_that_fails_stops_its_workers_and_engines(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The voices fail to load while the LLM engine builds beside them: the start raises that error,
    and afterwards no token2wav or LLM thread of it runs and each token2wav backend was closed (its
    idle compile processes end)."""
    closed: list[str] = []
    monkeypatch.setattr(TorchToken2Wav, "close", lambda backend: closed.append(str(backend.device)))

    async def unreadable(runtime: Runtime) -> bool:
        raise RuntimeError("the voices folder is unreadable")

    monkeypatch.setattr(Runtime, "_prepare_voices", unreadable)
    before = engine_threads()
    runtime = Runtime(ServiceConfig(models_dir=tiny_models, device="cpu", max_streams=2,
                                    token2wav_devices=("cpu", "cpu")))
    with pytest.raises(RuntimeError, match="voices folder is unreadable"):
        await runtime.start()
    assert engine_threads() == before
    assert closed == ["cpu", "cpu"]
