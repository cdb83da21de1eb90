"""engines/cuda_graphs.py across threads: what may run while another thread captures a graph."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engines import cuda_graphs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


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


def test_free_bytes_does_not_wait_for_a_capture_under_way() -> None:
    """The start's measure while the LLM builds (`free_bytes`) takes no capture lock, and counts what the
    allocator holds unused as free."""
    device = torch.device("cuda")
    held = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    del held  # now cached, unused
    measured: list[int] = []
    with cuda_graphs._CAPTURING:  # as a capture whose warm-up compiles holds it
        reader = threading.Thread(target=lambda: measured.append(cuda_graphs.free_bytes(device)))
        reader.start()
        reader.join(10)
    assert measured and measured[0] >= torch.cuda.mem_get_info(device)[0] + (256 << 20)
