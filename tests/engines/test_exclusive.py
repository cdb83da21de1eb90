"""engines/exclusive.py: tracing for an ahead-of-time compile and start-up module calls on other threads,
one at a time (a cold start failed when a voice was prepared while the LLM thread compiled)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from engines.config import ModelPaths
from engines.exclusive import EXCLUSIVE
from engines.precompiled import PrecompiledFunction, supported
from engines.token2wav.torch_backend import TorchToken2Wav
from engines.voice import VoicePrompt


class WaitingModule(nn.Module):
    """A forward that stops half-way until told to go on: a trace held open."""

    def __init__(self, tracing: threading.Event, go_on: threading.Event) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.tracing, self.go_on = tracing, go_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tracing.set()
        assert self.go_on.wait(10)
        return self.linear(x)


def test_a_module_called_on_another_thread_while_fx_traces_goes_to_the_tracer() -> None:
    """The hazard itself, in torch: fx's tracer replaces nn.Module.__call__ for every thread while it
    traces, so another thread's module call fails. (If a torch stops doing so, this test says it.)"""
    tracing, go_on = threading.Event(), threading.Event()
    traced = threading.Thread(target=torch.fx.symbolic_trace, args=(WaitingModule(tracing, go_on),))
    traced.start()
    try:
        assert tracing.wait(10)
        with pytest.raises(NameError, match="not installed as a submodule"):
            nn.Linear(4, 4)(torch.ones(4))
    finally:
        go_on.set()
        traced.join(10)
    nn.Linear(4, 4)(torch.ones(4))  # after the trace, calls work again


def test_a_voice_preparation_waits_for_a_trace_under_way(tiny_models: Path) -> None:
    """A trace held open under the lock (as a compile holds it): the tiny token2wav's voice preparation on
    another thread waits for it, then succeeds (without the lock it failed as above)."""
    t2w = TorchToken2Wav.from_models_dir(tiny_models, "dit", torch.device("cpu"))
    voice = VoicePrompt.load(ModelPaths(tiny_models).voices / "default.safetensors")
    tracing, go_on, prepared = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def trace() -> None:
        with EXCLUSIVE:
            torch.fx.symbolic_trace(WaitingModule(tracing, go_on))

    def prepare() -> None:
        try:
            t2w.prepare_speaker(voice)
        except BaseException as exc:
            errors.append(exc)
        prepared.set()

    tracer, preparer = threading.Thread(target=trace), threading.Thread(target=prepare)
    tracer.start()
    try:
        assert tracing.wait(10)
        preparer.start()
        assert not prepared.wait(0.5)  # waiting for the lock
    finally:
        go_on.set()
        tracer.join(10)
        preparer.join(30)
    assert prepared.is_set() and not errors, errors


def scaled_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, None, 1e-5) * 2 + 1


@pytest.mark.skipif(not supported(), reason="this torch has no ahead-of-time compile")
def test_an_ahead_of_time_compile_traces_holding_the_lock(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Whenever nn.Module.__call__ is replaced during a real compile (PrecompiledFunction, as the LLM's
    fused functions compile at a cold start), another thread cannot take the lock."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    # As at a cold start: AOTAutograd traces (a cached graph would skip the trace).
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    original_call = nn.Module.__call__
    function = PrecompiledFunction(scaled_norm, tmp_path / "norm", scaled_norm)
    compiled = threading.Event()
    taken_while_tracing: list[bool] = []

    def sample() -> None:
        while not compiled.is_set():
            if nn.Module.__call__ is not original_call:
                taken = EXCLUSIVE.acquire(blocking=False)
                if taken:
                    EXCLUSIVE.release()
                taken_while_tracing.append(taken)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        function(torch.randn(3, 8), torch.randn(8))
    finally:
        compiled.set()
        sampler.join(10)
    assert function.compiled == 1 and not function.failed
    assert taken_while_tracing and not any(taken_while_tracing)


def test_a_compiled_function_that_is_not_kept_traces_under_the_lock_until_sealed() -> None:
    """`compile_kept` without a folder gives a `torch.compile`d function that traces in each process: its
    calls hold the lock until sealed, then none does."""
    from engines.precompiled import TracedInProcess, compile_kept, seal_kept

    def owned() -> bool:
        return EXCLUSIVE._is_owned()  # type: ignore[attr-defined]

    function = TracedInProcess(owned)
    assert function() is True
    seal_kept(function)
    assert function() is False
    assert isinstance(compile_kept(scaled_norm, None, "norm", (), None, inference=False), TracedInProcess)
