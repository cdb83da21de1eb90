"""engines/cuda_graphs.py across threads: what may run while another thread captures a graph, and what
the capturing thread itself must not do (collect cycles holding graphs)."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from engines import cuda_graphs
from engines.exclusive import EXCLUSIVE

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_collector_is_paused_inside_and_left_as_it_was() -> None:
    enabled = gc.isenabled()
    try:
        gc.enable()
        with pytest.raises(RuntimeError), cuda_graphs.collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("the capture failed")
        assert gc.isenabled()
        gc.disable()  # a caller that had it off keeps it off
        with cuda_graphs.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        (gc.enable if enabled else gc.disable)()


def test_conv_plans_are_measured_inside_only() -> None:
    """A half-precision vocoder's chunk graphs measure cuDNN's plans in their warm-up runs; the flag is
    back as it was afterwards, on an error too, so the serving path's eager convolutions never stop to
    time plans."""
    benchmark = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = False
        with pytest.raises(RuntimeError), cuda_graphs.measured_conv_plans():
            assert torch.backends.cudnn.benchmark
            raise RuntimeError("the warm-up failed")
        assert not torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True  # an operator who set it keeps it
        with cuda_graphs.measured_conv_plans():
            assert torch.backends.cudnn.benchmark
        assert torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = benchmark


@pytest.mark.gpu
@needs_cuda
def test_empty_cache_waits_for_a_capture_under_way_on_another_thread() -> None:
    """PyTorch's allocator asserts when its cache is emptied during any thread's capture: the engines'
    `empty_cache` (admission's measure at ready, an LLM's stop) returns only once the capture ended."""
    device = torch.device("cuda")
    x = torch.ones(1024, device=device)
    recording, ended = threading.Event(), threading.Event()

    def captured() -> None:
        assert torch.cuda.is_current_stream_capturing()
        recording.set()
        time.sleep(0.3)  # the other thread empties the cache meanwhile
        x.mul_(2)

    def capture() -> None:
        cuda_graphs.capture_graph(captured, None, torch.cuda.Stream(device), warmup=lambda: x.mul_(1))
        ended.set()

    capturing = threading.Thread(target=capture)
    capturing.start()
    assert recording.wait(10)
    cuda_graphs.empty_cache()
    assert ended.is_set()  # it waited for the capture
    capturing.join(10)


@pytest.mark.gpu
@needs_cuda
def test_free_bytes_does_not_wait_for_a_capture_under_way() -> None:
    """The start's measure while the LLM builds (`free_bytes`) takes no capture lock, and counts what the
    allocator holds unused as free."""
    device = torch.device("cuda")
    held = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    del held  # now cached, unused
    measured: list[int] = []
    with EXCLUSIVE:  # as a capture whose warm-up compiles holds it
        reader = threading.Thread(target=lambda: measured.append(cuda_graphs.free_bytes(device)))
        reader.start()
        reader.join(10)
    assert measured and measured[0] >= torch.cuda.mem_get_info(device)[0] + (256 << 20)


@pytest.mark.gpu
@needs_cuda
def test_the_collector_waits_while_a_graph_is_captured() -> None:
    """A collection set off inside a capture would free cyclic garbage there, and destroying a CUDA graph
    among it breaks the capture (the GPU tests' warm-up once failed so, after tests that left graphs in
    cycles): the collector is off from the capture's start to its end, and on again after it."""
    device = torch.device("cuda")
    x = torch.ones(1024, device=device)
    collector_on: list[bool] = []

    def captured() -> None:
        collector_on.append(gc.isenabled())
        x.mul_(2)

    graph = cuda_graphs.capture_graph(captured, None, torch.cuda.Stream(device), warmup=lambda: x.mul_(1))
    assert collector_on == [False] and gc.isenabled()
    before = x.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, before * 2)
