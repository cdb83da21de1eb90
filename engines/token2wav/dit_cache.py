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

    @property
    def prompt(self) -> list[int] | None:
        """The prompt frames still attended to, ascending; None when all of them are."""
        kept = sorted(frame for frame in self.order if frame < self.prompt_frames)
        return None if len(kept) == self.prompt_frames else kept

    @property
    def own(self) -> list[int]:
        """The generated frames still attended to (utterance frame numbers), ascending."""
        return sorted(frame for frame in self.order if frame >= self.prompt_frames)

    def after_chunk(self, frames: int) -> EstimatorKeys:
        """The keys once a chunk of `frames` new frames has run and the cache has been trimmed."""
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

    def kept_positions(self, after: EstimatorKeys) -> list[int]:
        """Where `after.own` sits in [self.own, the chunk's frames] (the cache a chunk's solve returns
        before trimming, oldest first): the positions to gather as the stream's new own cache."""
        candidates = self.own + list(range(self.prompt_frames + self.generated,
                                           self.prompt_frames + after.generated))
        kept = set(after.own)
        return [position for position, frame in enumerate(candidates) if frame in kept]
