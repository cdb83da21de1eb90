"""Python's garbage collector in a realtime process: the start's objects left out of later collections,
and every collection's pause counted for /metrics.

A collection of the oldest generation walks every tracked object while it holds the GIL, and meanwhile no
thread launches GPU work or sends audio. After the engines load there are ~400k such objects (torch,
Dynamo and Inductor, the app): 0.1–0.2 s a full collection on the 2-core dev machine. None of what the
start made is garbage a later collection should look for (modules, the models' wrappers, compiled code),
so once ready they are frozen (`gc.freeze`, into the permanent generation) and collections walk only what
serving made; at stop they go back (`gc.unfreeze`), so a process that starts several services (tests)
can still collect them. Reference counting still frees a frozen object once unused; only a cycle among
them (a voice prepared at start and deleted later, say) waits for the stop.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

# Upper bounds (seconds) of the pause histogram's buckets; a 1.1 ms LLM decode step is the scale.
PAUSE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
GENERATIONS = 3


class GcPauses:
    """Counts each collection's pause by generation while `watching` (`gc.callbacks` is process-wide).

    The callback only bumps integers and floats: it runs inside a collection, in whichever thread's
    allocation set it off, so it takes no lock (one collection runs at a time in the process)."""

    def __init__(self) -> None:
        self.counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(GENERATIONS)]  # last: above all
        self.seconds = [0.0] * GENERATIONS
        self._started: float | None = None  # None: a "stop" without its "start" (added mid-collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause, self._started = time.perf_counter() - self._started, None
        generation = min(int(info["generation"]), GENERATIONS - 1)
        self.counts[generation][bisect.bisect_left(PAUSE_BUCKETS, pause)] += 1
        self.seconds[generation] += pause

    @contextlib.contextmanager
    def watching(self) -> Iterator[GcPauses]:
        """Count pauses while inside; the callback is removed on the way out."""
        gc.callbacks.append(self._on_collection)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._on_collection)


# Services inside a freeze: the collector is the process's, so the first to enter freezes and the last to
# leave unfreezes (several services in one process, as in tests, must not unfreeze each other's objects).
_frozen_services = 0


@contextlib.contextmanager
def start_objects_frozen() -> Iterator[int]:
    """Collect once, then freeze every object left (what the start made) until the block ends, unless
    another service of the process froze already; yields how many objects are frozen."""
    global _frozen_services
    if _frozen_services == 0:
        gc.collect()
        gc.freeze()
        logger.info("%d objects from the start left out of garbage collection", gc.get_freeze_count())
    _frozen_services += 1
    try:
        yield gc.get_freeze_count()
    finally:
        _frozen_services -= 1
        if _frozen_services == 0:
            gc.unfreeze()
