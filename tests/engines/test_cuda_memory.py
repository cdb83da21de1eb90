"""The serving process asks the CUDA allocator for expandable segments unless the operator chose."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engines.cuda_memory import ALLOCATOR_ENV, EXPANDABLE_SEGMENTS, use_expandable_segments


def test_expandable_segments_when_nothing_is_configured() -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    assert use_expandable_segments(environ) is None
    assert environ == {"PATH": "/bin", ALLOCATOR_ENV: EXPANDABLE_SEGMENTS}


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_an_operators_setting_is_kept(name: str) -> None:
    environ = {name: "expandable_segments:False,max_split_size_mb:512"}
    assert use_expandable_segments(environ) == name
    assert environ == {name: "expandable_segments:False,max_split_size_mb:512"}


def test_an_empty_variable_counts_as_unset() -> None:
    environ = {ALLOCATOR_ENV: ""}
    assert use_expandable_segments(environ) is None
    assert environ == {ALLOCATOR_ENV: EXPANDABLE_SEGMENTS}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_allocator_makes_expandable_segments() -> None:
    # A fresh process: the allocator reads its settings once, when it starts.
    probe = (
        "import os, torch\n"
        "from engines.cuda_memory import use_expandable_segments\n"
        "for name in ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF'):\n"
        "    os.environ.pop(name, None)\n"
        "use_expandable_segments()\n"
        "x = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')\n"
        "print(all(s['is_expandable'] for s in torch.cuda.memory_snapshot()))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
