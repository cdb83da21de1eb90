"""Which cached frames a streaming DiT chunk attends to, and which noise columns it starts from (§5.5).

Pure bookkeeping over utterance frame numbers (prompt frames 0 … L_p − 1, then the generated frames);
the flow applies it to its key/value tensors. Two rules (`CacheRule`):

- "reference" (default): what Step-Audio2's streaming driver computes. Its DiT stores a chunk's keys
  before the cached ones (newest chunk first), and after every chunk whose cache then exceeds L_p + R
  (R = 100) keeps the slices [:L_p] and [-R:] of that order: the first L_p entries (the newest chunks,
  each in time order, so a chunk longer than L_p keeps its *first* L_p frames) and the last R entries
  (after the first trim: a fixed set, the prompt's last R frames when L_p ≥ R). A chunk's noise starts
  at column = the cache length before it, which stays L_p + R once trimming has begun.
- "prompt_recent": the whole prompt plus the R most recent generated frames, and noise at the chunk's
  absolute utterance frame (the offline solve's column). Memory per stream: R frames instead of
  L_p + R. An option, off by default (docs/fidelity.md compares both against offline output).

Attention in the DiT has no positions and no mask in chunk mode, so only the set of kept frames
matters, not their order; the order is tracked only because the reference's trim is defined on it.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Literal, get_args

CacheRule = Literal["reference", "prompt_recent"]
CACHE_RULES: tuple[CacheRule, ...] = get_args(CacheRule)


def cached_frame_elements(steps: int, depth: int, heads: int, head_dim: int) -> int:
    """Elements one cached frame of one stream takes: a key and a value per head, in every block of every
    Euler step, for both guidance halves (the memory bounds' u, times the dtype's size)."""
    return steps * depth * 2 * heads * 2 * head_dim


@dataclass(frozen=True)
class EstimatorKeys:
    """The frames a stream's estimator cache holds before its next chunk.

    order: utterance frame of every cached key, in the reference's key order (newest chunk first);
    generated: mel frames generated so far.

    What a batched call asks of every row (`prompt`, `own`, the next keys and where they sit) walks
    `order`, up to L_p + R frames, in Python. Each instance works it out once: its derived values are
    kept, and so is its latest successor, so streams of one voice in step (`DiTSpeaker.keys`, shared)
    share their keys objects and a call of 64 such rows works it out once, not 64 times. Only the
    latest successor is kept (a final chunk of another length replaces it), and weakly: the streams hold
    their keys, a voice holds no chain of them.
    """

    rule: CacheRule
    recent: int
    prompt_frames: int
    generated: int
    order: tuple[int, ...]

    @staticmethod
    def start(rule: CacheRule, recent: int, prompt_frames: int) -> EstimatorKeys:
        """A fresh stream: the prompt's keys (what `prepare_speaker` computed), nothing generated."""
        if rule not in CACHE_RULES:
            raise ValueError(f"unknown estimator cache rule {rule!r}; expected one of {CACHE_RULES}")
        if recent < 0 or prompt_frames < 0:
            raise ValueError(f"recent ({recent}) and prompt_frames ({prompt_frames}) must be ≥ 0")
        return EstimatorKeys(rule, recent, prompt_frames, 0, tuple(range(prompt_frames)))

    @property
    def noise_offset(self) -> int:
        """Noise column of the next chunk's first frame."""
        if self.rule == "reference":
            return len(self.order)
        return self.prompt_frames + self.generated

    @functools.cached_property
    def prompt(self) -> tuple[int, ...] | None:
        """The prompt frames still attended to, ascending; None when all of them are."""
        kept = tuple(sorted(frame for frame in self.order if frame < self.prompt_frames))
        return None if len(kept) == self.prompt_frames else kept

    @functools.cached_property
    def own(self) -> tuple[int, ...]:
        """The generated frames still attended to (utterance frame numbers), ascending."""
        return tuple(sorted(frame for frame in self.order if frame >= self.prompt_frames))

    def after_chunk(self, frames: int) -> EstimatorKeys:
        """The keys once a chunk of `frames` new frames has run and the cache has been trimmed."""
        return self._successor(frames)[0]

    def kept_positions(self, after: EstimatorKeys) -> tuple[int, ...]:
        """Where `after.own` sits in [self.own, the chunk's frames] (the cache a chunk's solve returns
        before trimming, oldest first): the positions to gather as the stream's new own cache."""
        successor, kept = self._successor(after.generated - self.generated)
        return kept if successor is after else self._kept_positions(after)

    def _successor(self, frames: int) -> tuple[EstimatorKeys, tuple[int, ...]]:
        """The keys after a chunk of `frames` and their kept positions, worked out once while `frames`
        stays the latest asked for. One attribute holds them, replaced whole: lanes may ask at once."""
        latest: tuple[int, weakref.ref[EstimatorKeys], tuple[int, ...]] | None = self.__dict__.get("_latest")
        if latest is not None and latest[0] == frames:
            after = latest[1]()
            if after is not None:
                return after, latest[2]
        after = self._after_chunk(frames)
        kept = self._kept_positions(after)
        # Weakly: the streams that moved on hold it, and a voice's keys hold no chain once they end.
        self.__dict__["_latest"] = (frames, weakref.ref(after), kept)  # frozen: not through __setattr__
        return after, kept

    def _after_chunk(self, frames: int) -> EstimatorKeys:
        first = self.prompt_frames + self.generated
        new = tuple(range(first, first + frames))
        if self.rule == "reference":
            order = new + self.order
            if len(order) > self.prompt_frames + self.recent:
                order = order[: self.prompt_frames] + order[len(order) - self.recent :]
        else:
            recent_start = max(self.prompt_frames, first + frames - self.recent)
            order = tuple(range(self.prompt_frames)) + tuple(range(recent_start, first + frames))
        return EstimatorKeys(self.rule, self.recent, self.prompt_frames, self.generated + frames, order)

    def _kept_positions(self, after: EstimatorKeys) -> tuple[int, ...]:
        first = self.prompt_frames + self.generated
        candidates = (*self.own, *range(first, first + after.generated - self.generated))
        kept = set(after.own)
        return tuple(position for position, frame in enumerate(candidates) if frame in kept)
