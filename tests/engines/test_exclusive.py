"""engines/exclusive.py: tracing for an ahead-of-time compile and start-up module calls on other threads,
one at a time (a cold start failed when a voice was prepared while the LLM thread compiled)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

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
    """Each time a real compile (PrecompiledFunction, as the LLM's fused functions compile at a cold start)
    replaces nn.Module.__call__, the compiling thread holds the lock. Recorded at the replacement itself:
    a thread sampling for the short window missed it on a loaded CI machine."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch.fx._symbolic_trace import _Patcher

    # As at a cold start: AOTAutograd traces (a cached graph would skip the trace). Without the autograd
    # cache the variant cannot be serialized, so its save logs a warning here.
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    held_at_replacement: list[bool] = []
    patch_method = _Patcher.patch_method

    def recording_patch_method(self: _Patcher, cls: type, name: str, *args: Any, **kwargs: Any) -> None:
        if cls is nn.Module and name == "__call__":
            held_at_replacement.append(EXCLUSIVE._is_owned())  # type: ignore[attr-defined]
        patch_method(self, cls, name, *args, **kwargs)

    monkeypatch.setattr(_Patcher, "patch_method", recording_patch_method)
    function = PrecompiledFunction(scaled_norm, tmp_path / "norm", scaled_norm)
    function(torch.randn(3, 8), torch.randn(8))
    assert function.compiled == 1 and not function.failed
    assert held_at_replacement and all(held_at_replacement), held_at_replacement
    # The recording itself sees an unlocked replacement: a trace outside the lock.
    held_at_replacement.clear()
    torch.fx.symbolic_trace(nn.Linear(2, 2))
    assert held_at_replacement == [False]


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
