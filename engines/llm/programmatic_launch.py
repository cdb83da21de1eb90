"""Programmatic dependent launch (PDL) for a decode step's Triton kernels (CUDA, Hopper and later).

A decode step at a few rows is a chain of short kernels (per layer: q|k|v, attention, o_proj, gate|up,
down), each a few µs, and in a CUDA graph each one's launch begins only when the one before has ended.
Launched with PDL, a kernel is scheduled while its predecessor still runs and waits on the device
(`griddepcontrol.wait`) before it touches memory; the predecessor lets it start once all its programs are
past their main loop (`griddepcontrol.launch_dependents`). The wait comes before every load and store,
so the results are those of plain launches, bit for bit; what overlaps is the launch and scheduling of
one kernel with the tail of the one before. A kernel that waits is safe after any predecessor, PDL or
not: without the signal the wait ends when the predecessor does.
"""

from __future__ import annotations

from typing import Any

import torch


def supported(device: torch.device) -> bool:
    """Whether this device and Triton launch kernels with PDL (compute capability 9.0 or later)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    import triton.language as tl
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")


def launch_options(programmatic: bool) -> dict[str, Any]:
    """Keyword arguments of a Triton launch: PDL's where asked (none otherwise, for any Triton)."""
    return {"launch_pdl": True} if programmatic else {}
