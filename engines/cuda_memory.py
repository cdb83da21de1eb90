"""The CUDA caching allocator's mode for a serving process: expandable segments.

With fixed-size segments, a segment goes back to the driver only once every block in it is free, so
the warm-up's freed blocks mostly stay reserved: on an H100 the service sat at 55 GiB in use when idle
(31 GiB of tensors outside the graphs' pools) and the token2wav memory budget, what is free after the
warm-up, admitted 89 streams of the default voice. With expandable segments each pool grows and shrinks
one virtual range by mapping pages, so freed memory can return: 46 GiB in use when idle and 141 streams
admitted (docs/benchmarks.md, seventh session). The setting is read when the allocator starts, so it is
made before the process's first CUDA allocation, and only where the operator has not chosen one.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# The variable torch reads (the older name; torch ≥ 2.9 also reads PYTORCH_ALLOC_CONF, but 2.9.1 ignored
# expandable_segments there) and the one an operator may have used instead.
ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
OPERATOR_ENVS = (ALLOCATOR_ENV, "PYTORCH_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Ask for expandable segments unless the environment already configures the allocator. Returns the
    variable the operator set (left as it is), or None when the setting was made here."""
    chosen = next((name for name in OPERATOR_ENVS if environ.get(name)), None)
    if chosen is None:
        environ[ALLOCATOR_ENV] = EXPANDABLE_SEGMENTS
    return chosen
