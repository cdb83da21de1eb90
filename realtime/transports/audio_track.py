"""The server's outgoing WebRTC audio: a bounded playout buffer and the track aiortc pulls from it.

aiortc pulls ``recv()`` from its sender task and encodes each frame to Opus; the track paces itself on
the media clock (48 kHz, 20 ms = 960 samples per frame), so frames leave in real time whether or not
speech is buffered: silence between utterances and on underrun, never a burst afterwards.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections import deque
from collections.abc import Callable

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

OPUS_RATE = 48_000
FRAME_SAMPLES = 960
FRAME_TIME_BASE = fractions.Fraction(1, OPUS_RATE)
# Later than this behind the media clock (the loop stalled): restart the clock instead of catching up.
MAX_LATENESS_S = 0.1


class Playout:
    """A bounded queue of 48 kHz int16 mono samples between one producer and the paced track.

    Samples live on one timeline: ``written`` counts every sample ever accepted, ``played`` every one
    handed to the track (or dropped by :meth:`clear`), so a producer can wait for a position to be
    played with :meth:`when_played`. The producer is throttled by :meth:`write` once ``capacity`` samples
    are buffered, so memory stays bounded (by ``capacity`` plus one write).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < FRAME_SAMPLES:
            raise ValueError(
                f"playout capacity must hold at least one frame ({FRAME_SAMPLES}), got {capacity}"
            )
        self._capacity = capacity
        self._chunks: deque[np.ndarray] = deque()
        self._buffered = 0
        self._written = 0
        self._played = 0
        self._space = asyncio.Event()
        self._space.set()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    @property
    def written(self) -> int:
        return self._written

    @property
    def played(self) -> int:
        return self._played

    async def write(self, samples: np.ndarray) -> None:
        """Append int16 samples, first waiting while the buffer is at capacity."""
        if samples.dtype != np.int16 or samples.ndim != 1:
            raise ValueError(f"playout takes 1-D int16 samples, got {samples.dtype} {samples.shape}")
        while self._buffered >= self._capacity:
            self._space.clear()
            await self._space.wait()
        if samples.size:
            self._chunks.append(samples)
            self._buffered += samples.size
            self._written += samples.size

    def read(self, count: int) -> np.ndarray:
        """Take exactly ``count`` samples, zero-filled past the end of what is buffered."""
        out = np.zeros(count, dtype=np.int16)
        filled = 0
        while filled < count and self._chunks:
            head = self._chunks[0]
            take = min(count - filled, head.size)
            out[filled : filled + take] = head[:take]
            filled += take
            if take == head.size:
                self._chunks.popleft()
            else:
                self._chunks[0] = head[take:]
        self._advance(filled)
        return out

    def clear(self) -> None:
        """Drop everything buffered; positions up to ``written`` count as reached."""
        self._chunks.clear()
        self._advance(self._buffered)

    def when_played(self, position: int) -> asyncio.Future[None]:
        """A future resolved once ``played >= position``; cancel it to stop waiting."""
        waiter = asyncio.get_running_loop().create_future()
        if self._played >= position:
            waiter.set_result(None)
        else:
            self._waiters.append((position, waiter))
        return waiter

    def _advance(self, count: int) -> None:
        self._buffered -= count
        self._played += count
        if self._buffered < self._capacity:
            self._space.set()
        pending = []
        for position, waiter in self._waiters:
            if waiter.done():
                continue
            if position <= self._played:
                waiter.set_result(None)
            else:
                pending.append((position, waiter))
        self._waiters = pending


class SpeechTrack(MediaStreamTrack):
    """An audio track of 20 ms s16 mono 48 kHz frames read from a :class:`Playout` in real time.

    ``clock`` is a monotonic seconds clock (injectable for tests). The first ``recv`` fixes the clock's
    origin; frame n is returned at origin + n * 20 ms, with contiguous pts in a 1/48000 time base.
    """

    kind = "audio"

    def __init__(self, playout: Playout, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._playout = playout
        self._clock = clock
        self._origin: float | None = None
        self._pts = 0

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = self._clock()
        if self._origin is None:
            self._origin = now
        delay = self._origin + self._pts / OPUS_RATE - now
        if delay < -MAX_LATENESS_S:
            self._origin = now - self._pts / OPUS_RATE
        elif delay > 0:
            await asyncio.sleep(delay)
        frame = av.AudioFrame.from_ndarray(
            self._playout.read(FRAME_SAMPLES)[np.newaxis, :], format="s16", layout="mono"
        )
        frame.sample_rate = OPUS_RATE
        frame.time_base = FRAME_TIME_BASE
        frame.pts = self._pts
        self._pts += FRAME_SAMPLES
        return frame
