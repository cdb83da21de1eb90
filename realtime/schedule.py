"""Chunk schedules: when enough speech tokens are pending to hand a chunk to token2wav (pure policy).

The streaming contract (MODEL_FACTS §8): with `offset` tokens already consumed and a hop of `h`, a chunk
is due once `h + 3` tokens are pending; it carries tokens `[offset, offset + h + 3)` (the 3 lookahead
tokens are handed again as the first tokens of the next chunk) and moves `offset` by `h`. When the
token stream has ended, one last chunk carries everything left, `[offset, end)`.

A `HopPolicy` only chooses `h` for chunk `i`; `ChunkScheduler` applies the contract. Nothing here
touches tensors, threads or clocks: measured speeds come in as plain numbers.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Protocol

from engines.config import PRE_LOOKAHEAD, STEADY_HOP


class ScheduleKind(enum.Enum):
    """The chunk schedules a request may ask for."""

    EXPONENTIAL = "exponential"
    EQUAL = "equal"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class Progress:
    """What the stream has measured so far, for policies that adapt to speed.

    audio_ahead_s: seconds of audio delivered beyond what real-time playback has consumed since the
        first chunk (how long the listener can wait for the next chunk without a gap).
    tokens_per_s: measured LLM decoding speed of this stream (0 when unknown).
    """

    audio_ahead_s: float = 0.0
    tokens_per_s: float = 0.0


class HopPolicy(Protocol):
    def hop(self, index: int, progress: Progress) -> int:
        """New tokens consumed by chunk `index` (0-based); always >= 1."""
        ...


@dataclass(frozen=True)
class ExponentialHops:
    """`first` tokens, then `base`·2^i for chunk i >= 1, capped at `limit` (15, 25, 50, 100, ...)."""

    first: int = 15
    base: int = 25
    limit: int = 400

    def __post_init__(self) -> None:
        if min(self.first, self.base, self.limit) < 1:
            raise ValueError(
                f"hops must be positive, got first={self.first} base={self.base} limit={self.limit}"
            )

    def hop(self, index: int, progress: Progress) -> int:
        if index == 0:
            return self.first
        return min(self.limit, self.base << min(index - 1, 30))


@dataclass(frozen=True)
class EqualHops:
    """The same hop for every chunk."""

    size: int = 25

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"hop size must be positive, got {self.size}")

    def hop(self, index: int, progress: Progress) -> int:
        return self.size


@dataclass(frozen=True)
class AdaptiveHops:
    """Chunks as large as the audio buffered ahead of the listener allows.

    The first chunk is `granule` tokens (lowest latency). Afterwards the next hop is the number of
    tokens the LLM is expected to decode while `safety` of the buffered audio plays, rounded down to a
    multiple of `granule` and kept within [granule, limit]: a fast engine gets large, efficient chunks,
    a slow one falls back to small chunks so the listener never starves.
    """

    granule: int = 15
    limit: int = 400
    safety: float = 0.5

    def __post_init__(self) -> None:
        if self.granule < 1 or self.limit < self.granule:
            raise ValueError(f"need 1 <= granule <= limit, got granule={self.granule} limit={self.limit}")
        if not 0 < self.safety <= 1:
            raise ValueError(f"safety must be in (0, 1], got {self.safety}")

    def hop(self, index: int, progress: Progress) -> int:
        if index == 0 or progress.tokens_per_s <= 0 or progress.audio_ahead_s <= 0:
            return self.granule
        affordable = progress.audio_ahead_s * self.safety * progress.tokens_per_s
        granules = max(1, math.floor(affordable / self.granule))
        return min(self.limit, granules * self.granule)


@dataclass(frozen=True)
class FirstChunkByLoad:
    """The exponential schedule's first hop for a new stream: `light_tokens` while fewer than
    `light_streams` streams are open on its token2wav worker, else `tokens` (light_streams 0: always).

    A shorter first chunk brings first audio sooner (fewer LLM steps before it, a shorter first token2wav
    call) but less of it, so the stream's second chunk is due sooner: on an idle GPU that costs nothing,
    on a busy one those second chunks come late. On an H200 (docs/benchmarks.md, thirty-seventh session)
    10-token first chunks for every stream took the p50 first audio of bursts of 1 / 16 / 64 streams from
    32 / 72 / 170 ms to 29 / 57 / 138, but kept bursts whole only up to 55 streams, 15-token ones up to
    126; this rule at 16 streams gave 30 / 63 / 220 ms and 96 (a burst's first chunks then came in two
    calls), so the service leaves it off by default.
    """

    tokens: int = ExponentialHops.first
    light_tokens: int = 10
    light_streams: int = 0

    def __post_init__(self) -> None:
        if min(self.tokens, self.light_tokens) < 1 or self.light_streams < 0:
            raise ValueError(f"need positive first hops and light_streams >= 0, got tokens={self.tokens} "
                             f"light_tokens={self.light_tokens} light_streams={self.light_streams}")

    def first_hop(self, open_streams: int) -> int:
        """The first hop of a stream that starts beside `open_streams` others on its worker."""
        return self.light_tokens if open_streams < self.light_streams else self.tokens

    @property
    def first_hops(self) -> tuple[int, ...]:
        """The first hops streams may get, `tokens` first."""
        light = self.light_streams > 0 and self.light_tokens != self.tokens
        return (self.tokens, self.light_tokens) if light else (self.tokens,)


def graphed_hops(first_hop: int = ExponentialHops.first) -> tuple[int, ...]:
    """The exponential schedule's hops before it reaches `STEADY_HOP` tokens (15, 25, 50, 100 by
    default): the chunk lengths whose token2wav graphs are captured at start-up."""
    policy, hops = ExponentialHops(first=first_hop), list[int]()
    while (hop := policy.hop(len(hops), Progress())) < STEADY_HOP:
        hops.append(hop)
    return tuple(hops)


def make_policy(kind: ScheduleKind, first_hop: int = ExponentialHops.first) -> HopPolicy:
    """The default policy of each kind; `first_hop`: the exponential schedule's first chunk (the other
    kinds choose their own)."""
    if kind is ScheduleKind.EXPONENTIAL:
        return ExponentialHops(first=first_hop)
    if kind is ScheduleKind.EQUAL:
        return EqualHops()
    if kind is ScheduleKind.ADAPTIVE:
        return AdaptiveHops()
    raise ValueError(f"unknown schedule kind {kind!r}")


@dataclass(frozen=True)
class Chunk:
    """Token range `[start, end)` to synthesise; `last` chunks flush everything left."""

    index: int
    start: int
    end: int
    last: bool

    @property
    def consumed(self) -> int:
        """Tokens this chunk moves the offset by (the lookahead of a non-final chunk is not consumed)."""
        return self.end - self.start if self.last else self.end - self.start - PRE_LOOKAHEAD


class ChunkScheduler:
    """Applies a hop policy to one growing token sequence."""

    def __init__(self, policy: HopPolicy) -> None:
        self._policy = policy
        self._offset = 0
        self._index = 0
        self._finished = False

    @property
    def offset(self) -> int:
        """Tokens consumed by the chunks taken so far."""
        return self._offset

    @property
    def finished(self) -> bool:
        """True once the last chunk was taken."""
        return self._finished

    def tokens_wanted(self, progress: Progress | None = None) -> int:
        """Tokens in all (consumed ones included) that the next chunk needs before it is due."""
        return self._offset + self._policy.hop(self._index, progress or Progress()) + PRE_LOOKAHEAD

    def next_chunk(self, available: int, ended: bool, progress: Progress | None = None) -> Chunk | None:
        """The chunk due with `available` tokens known, or None if more tokens are needed.

        `ended` says the token stream is complete: then the remaining tokens form the last chunk
        (possibly after non-final chunks, if many are pending). Call repeatedly until it returns None.
        """
        if self._finished:
            return None
        if available < self._offset:
            raise ValueError(f"available tokens went backwards: {available} < offset {self._offset}")
        hop = self._policy.hop(self._index, progress or Progress())
        if hop < 1:
            raise ValueError(f"hop policy returned {hop} for chunk {self._index}")
        pending = available - self._offset
        if pending >= hop + PRE_LOOKAHEAD and not (ended and pending == hop + PRE_LOOKAHEAD):
            chunk = Chunk(self._index, self._offset, self._offset + hop + PRE_LOOKAHEAD, last=False)
            self._offset += hop
        elif ended:
            chunk = Chunk(self._index, self._offset, available, last=True)
            self._offset = available
            self._finished = True
        else:
            return None
        self._index += 1
        return chunk


class Playback:
    """One listener's audio timeline, shared by the sessions that speak to it one after another (a
    websocket context's texts), on the sessions' clock: a chunk is due when the listener runs out of the
    audio produced for it so far. So a later text's first chunk is not first audio: it has a deadline
    behind the audio before it (a lower bound, since that text may still be producing)."""

    def __init__(self) -> None:
        self.started_at: float | None = None  # when the listener's first audio was produced
        self.produced_s = 0.0

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def due(self) -> float:
        """When the listener needs the next chunk (-inf before its first audio)."""
        return chunk_due(self.started_at, self.produced_s)

    def ahead_s(self, now: float) -> float:
        """Seconds of audio the listener has beyond what it played by `now` (0 before its first audio)."""
        return 0.0 if self.started_at is None else self.produced_s - (now - self.started_at)

    def produced(self, now: float, seconds: float) -> None:
        """`seconds` more audio for the listener, produced at `now`."""
        if self.started_at is None and seconds > 0:
            self.started_at = now
        self.produced_s += seconds


def chunk_due(first_audio_at: float | None, audio_sent_s: float) -> float:
    """When a stream needs its next chunk: the moment its listener runs out of the audio sent so far
    (`first_audio_at` + `audio_sent_s`, on the clock `first_audio_at` was read from). Before any audio
    was sent the chunk is due at once (-inf): first audio outranks every later chunk."""
    if first_audio_at is None:
        return -math.inf
    return first_audio_at + audio_sent_s

