"""The engines' work that the whole process shares, one thread at a time.

Two kinds of start-up work change state that every thread of the process sees:

- a CUDA graph capture with its warm-up run (engines/cuda_graphs.py): a first run may compile, and
  Triton's autotuning synchronises the device, which CUDA forbids while another thread captures;
- tracing for an ahead-of-time compile (engines/precompiled.py): AOTAutograd traces through torch.fx,
  whose tracer replaces `torch.nn.Module.__call__` on the class, for every thread, while it traces. A
  module called meanwhile on another thread goes to that tracer and fails ("module is not installed as
  a submodule": a cold start's voice preparation on the token2wav thread while the LLM thread compiled
  its fused functions, docs/benchmarks.md, twenty-eighth session).

`EXCLUSIVE` is held for each of those (a kept function's compile, and every call of a compiled function
that is not kept until it is sealed) and for the start-up calls that run modules beside them (a voice's
preparation, the token2wav warm-up's chunk passes). It is reentrant: a capture's warm-up run
or a voice's preparation may compile inside it. Serving calls do not take it: by then nothing compiles
(the kept functions are sealed), and a capture lets other threads launch meanwhile (its capture mode is
thread-local).
"""

from __future__ import annotations

import threading

EXCLUSIVE = threading.RLock()
