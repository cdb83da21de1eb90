"""Which waiting chunks a token2wav worker thread runs in its next batched call, and when (pure policy).

The worker (realtime/token2wav_worker.py) owns the threads, queues and futures; it hands this module
plain numbers about what waits and gets back a `Decision`: the chunks of the next call, or how long to
hold for more. The rules:

1. First audio before everything. While any stream waits for its first chunk (due -inf, see
   `realtime.schedule.chunk_due`), a call holds first chunks only, earliest arrival first: a first chunk
   never shares a call with (and so never waits for) another stream's later chunk. Later chunks, whose
   listeners have audio to play, go in the next call — unless one would run dry first: a later chunk
   due within `urgent_calls` recent token2wav calls (this call and its own) goes before the first
   chunks, with every other later chunk that urgent, earliest deadline first. In a burst the first
   chunks take several calls, and a stream whose first audio came in the first of them needs its second
   chunk 0.44 s later: an underrun is worse than first audio one call later.
2. First chunks that become ready close together share one call. Streams opened on the thread that
   have not sent their first chunk yet (`expected_first`) are the ones the LLM is still delivering
   first chunks for: while some are left and the call is not full, the policy holds until a gap after
   the latest first chunk arrived and at most `max_s` after the oldest one arrived. The gap is `gap_s`,
   or `steps` of the LLM's recent decode step if longer (first chunks of streams prefilled in different
   groups come a step or more apart; the next step's join, a later one's do not). With none expected
   it runs at once (a lone stream never waits).
3. Otherwise, earliest deadline first: the `max_rows` chunks whose listeners run out of audio soonest.
4. With `max_tokens`, a call takes at most that many speech tokens in all (at least one chunk): a call
   cannot be interrupted, so its length is how long a chunk that becomes urgent meanwhile waits. A
   stream's second chunk has the least slack (its listener has 0.44 s of first audio, part of which the
   LLM spends decoding the chunk's 25 tokens); on an H100 64 streams' 100-token chunks take 586 ms in
   one call, 64 second chunks (1600 tokens) ~160 ms.

Nothing here reads a clock or touches a thread: time comes in as `now`, on the clock the arrivals were
stamped with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FirstChunkHold:
    """How long a first chunk may wait for the first chunks of other new streams, to share their call:
    while they keep coming (one came within the gap: `gap_s`, or `steps` LLM decode steps if longer),
    and `max_s` in all."""

    gap_s: float = 0.004
    max_s: float = 0.012
    steps: float = 1.5

    def __post_init__(self) -> None:
        # max_s bounds the gap too: max_s = 0 turns holding off. (`not >= 0` refuses NaN as well.)
        if not (self.gap_s >= 0 and self.max_s >= 0):
            raise ValueError(f"need gap_s >= 0 and max_s >= 0, got gap_s={self.gap_s} max_s={self.max_s}")
        if not self.steps >= 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")

    def gap(self, llm_step_s: float) -> float:
        """The gap after the latest arrival, for an LLM decode step of `llm_step_s` (0: unknown)."""
        return min(self.max_s, max(self.gap_s, self.steps * llm_step_s))


@dataclass(frozen=True)
class WaitingChunk:
    """A chunk waiting for a call: when its listener needs it (-inf: the stream's first audio), its
    arrival order (ascending) and arrival time."""

    due: float
    order: int
    arrived: float
    tokens: int = 0  # speech tokens the chunk carries: the work it adds to a call

    @property
    def first(self) -> bool:
        """The chunk of a stream's first audio."""
        return self.due == -math.inf


@dataclass(frozen=True)
class Decision:
    """`run`: indices into the waiting chunks, the next call's rows in order; empty with `hold_until`
    set: run nothing until then (or until more arrives); empty without: nothing waits."""

    run: tuple[int, ...] = ()
    hold_until: float | None = None


@dataclass(frozen=True)
class BatchPolicy:
    """`max_rows`: most chunks in one call; `hold`: how first chunks wait for each other; `max_tokens`:
    most speech tokens in one call (None: no limit), though a call always takes one chunk;
    `urgent_calls`: how many recent calls ahead a later chunk's deadline makes it urgent (rule 1)."""

    max_rows: int
    hold: FirstChunkHold = FirstChunkHold()
    max_tokens: int | None = None
    urgent_calls: float = 2.0  # 0: first chunks always go first

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError(f"a call needs at least one row, got max_rows={self.max_rows}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive or None, got {self.max_tokens}")
        if not self.urgent_calls >= 0:
            raise ValueError(f"urgent_calls must be >= 0, got {self.urgent_calls}")

    def decide(self, waiting: Sequence[WaitingChunk], expected_first: int, now: float,
               llm_step_s: float = 0.0, call_s: float = 0.0) -> Decision:
        """The next call for `waiting`, with `expected_first` streams yet to send their first chunk, the
        LLM's recent decode step (`llm_step_s`) and the recent token2wav call (`call_s`; 0: unknown)."""
        firsts = [i for i, chunk in enumerate(waiting) if chunk.first]
        if firsts and call_s > 0 and self.urgent_calls > 0:
            horizon = now + self.urgent_calls * call_s
            urgent = [i for i, chunk in enumerate(waiting) if not chunk.first and chunk.due < horizon]
            if urgent:
                urgent.sort(key=lambda i: (waiting[i].due, waiting[i].order))
                return Decision(run=self._call(waiting, urgent))
        if firsts:
            if expected_first > 0 and len(firsts) < self.max_rows:
                hold_until = min(
                    min(waiting[i].arrived for i in firsts) + self.hold.max_s,
                    max(waiting[i].arrived for i in firsts) + self.hold.gap(llm_step_s),
                )
                if now < hold_until:
                    return Decision(hold_until=hold_until)
            firsts.sort(key=lambda i: waiting[i].order)
            return Decision(run=self._call(waiting, firsts))
        by_deadline = sorted(range(len(waiting)), key=lambda i: (waiting[i].due, waiting[i].order))
        return Decision(run=self._call(waiting, by_deadline))

    def _call(self, waiting: Sequence[WaitingChunk], ranked: Sequence[int]) -> tuple[int, ...]:
        """The leading chunks of `ranked` that fit one call: `max_rows`, and `max_tokens` past the first."""
        taken = list(ranked[: self.max_rows])
        if self.max_tokens is not None:
            total = 0
            for count, index in enumerate(taken):
                total += waiting[index].tokens
                if count and total > self.max_tokens:
                    del taken[count:]
                    break
        return tuple(taken)


class RecentStepTime:
    """A recent step time from a cumulative step count and step seconds (the LLM's decode steps from
    `LLMStats`, a token2wav thread's calls): the mean over the steps since the previous reading, smoothed
    by `weight` (the newest reading's)."""

    def __init__(self, weight: float = 0.5) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self._weight = weight
        self._steps = 0
        self._seconds = 0.0
        self.seconds = 0.0  # 0 until a step was seen

    def read(self, steps: int, seconds: float) -> float:
        """Take the counters' new totals; return the recent step time."""
        if steps > self._steps:
            sample = (seconds - self._seconds) / (steps - self._steps)
            previous = self.seconds or sample
            self.seconds = previous + self._weight * (sample - previous)
        self._steps, self._seconds = steps, seconds
        return self.seconds

    def record(self, seconds: float) -> None:
        """Take one more step of `seconds` (for a caller that times its own steps)."""
        self.read(self._steps + 1, self._seconds + seconds)


__all__ = ["BatchPolicy", "Decision", "FirstChunkHold", "RecentStepTime", "WaitingChunk"]
