"""Splitting a GPU's SMs between the LLM engine and token2wav (engines/sm_partition.py).

On CUDA, a kernel reports the SM each of its programs ran on (%smid): work on one group's streams, and
CUDA graphs captured on them, stay on that group's SMs, and the two groups' SMs are disjoint.
"""

from __future__ import annotations

import pytest
import torch

from engines.sm_partition import DeviceStreams, SmPartitionError, device_sms, split_sms

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DECODE_SMS = 16
LANES = 32  # threads per program that record their SM


def sm_ids(programs: int) -> torch.Tensor:
    """Launch a kernel of `programs` programs on the current stream; each writes the SM it ran on."""
    import triton
    import triton.language as tl

    @triton.jit
    def record_sm(out_ptr, lanes: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, lanes)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [offsets], dtype=tl.int32,
                                       is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0) * lanes + offsets, sm)

    out = torch.full((programs * LANES,), -1, dtype=torch.int32, device="cuda")
    record_sm[(programs,)](out, LANES)
    return out


def used_sms(ids: torch.Tensor) -> set[int]:
    torch.cuda.synchronize()
    return set(ids.cpu().tolist())


def test_each_group_keeps_to_its_own_sms() -> None:
    device = torch.device("cuda")
    partition = split_sms(device, DECODE_SMS)
    total = device_sms(device)
    assert partition.decode.sms >= DECODE_SMS
    assert partition.decode.sms + partition.token2wav.sms <= total
    programs = 8 * total  # far more programs than either group has SMs
    seen = {}
    for name, group in (("decode", partition.decode), ("token2wav", partition.token2wav)):
        with torch.cuda.stream(group.stream()):
            seen[name] = used_sms(sm_ids(programs))
        assert -1 not in seen[name]
        assert len(seen[name]) <= group.sms
    assert not seen["decode"] & seen["token2wav"]
    with torch.cuda.stream(DeviceStreams(device).stream()):
        whole = used_sms(sm_ids(programs))
    assert len(whole) > partition.decode.sms  # the check above could tell a group from the whole device


def test_a_graph_captured_on_a_group_replays_on_its_sms() -> None:
    device = torch.device("cuda")
    partition = split_sms(device, DECODE_SMS)
    programs = 8 * device_sms(device)
    capture = partition.decode.stream()
    sm_ids(programs)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture):
        graph.capture_begin(capture_error_mode="thread_local")
        ids = sm_ids(programs)
        graph.capture_end()
    with torch.cuda.stream(partition.decode.stream(priority=-1)):  # the engine serves on another stream
        ids.fill_(-1)
        graph.replay()
        seen = used_sms(ids)
    assert -1 not in seen
    assert len(seen) <= partition.decode.sms
    with torch.cuda.stream(partition.token2wav.stream()):
        others = used_sms(sm_ids(programs))
    assert not seen & others


def test_a_split_the_driver_cannot_make_is_refused() -> None:
    device = torch.device("cuda")
    with pytest.raises(SmPartitionError):
        split_sms(device, device_sms(device) + 8)
