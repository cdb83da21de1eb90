"""token2wav worker threads: the bridge between sessions on the event loop and a token2wav backend.

Sessions hand chunks to a `Token2WavWorker` with a deadline and await futures; each turn a worker
thread runs the `max_batch` most urgent of the chunks waiting for it (earliest deadline first: first
audio before everything, then the chunk whose listener runs out of audio soonest) with one
`run_chunks` call, the point where a GPU backend batches streams. A stream is opened, run and closed on
one thread, so its chunks keep their order and its tensors stay on that thread's CUDA stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from engines.token2wav.base import ChunkJob, SpeakerState, Token2Wav, Token2WavStream
from engines.voice import VoicePrompt
from realtime.metrics import Metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class FirstChunkLinger:
    """How long a first chunk may wait for the first chunks of other new streams, to share their batch:
    while they keep coming (one came within `gap_s`), and `max_s` in all. Streams that start together
    get their first tokens a few LLM steps apart (their prompts are prefilled in groups)."""

    gap_s: float = 0.004
    max_s: float = 0.012


@dataclass
class _ChunkTask:
    job: ChunkJob
    due: float  # when the listener needs this chunk; earliest first
    future: Future[np.ndarray]
    order: int  # arrival order, breaks ties between equal deadlines
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def urgency(self) -> tuple[float, int]:
        return self.due, self.order


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future[Any] | None


class _Lane:
    """One token2wav thread with its own inbox (and its own CUDA stream on CUDA).

    Each turn it moves everything in its inbox to its pending chunks and calls, runs the `max_batch`
    most urgent chunks (earliest deadline first) in one `run_chunks` call, then the calls. The chunks
    left pending wait for the next turn. A stream's close is only queued once its chunk is finished or
    cancelled, and cancelled chunks are dropped before the calls run, so a close never overtakes a
    chunk of its stream.
    """

    def __init__(self, name: str, backend: Token2Wav, max_batch: int, linger: FirstChunkLinger,
                 metrics: Metrics | None) -> None:
        self.inbox: queue.SimpleQueue[_ChunkTask | _Call | None] = queue.SimpleQueue()
        self.assigned = 0  # streams routed here and not yet closed (event loop side)
        self.open_streams = 0  # streams opened here and not yet closed (this thread's side)
        self.fresh: set[Token2WavStream] = set()  # opened here, no chunk received yet (this thread's side)
        self._linger_policy = linger
        self._backend = backend
        self._max_batch = max_batch
        self._metrics = metrics
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._pending: list[_ChunkTask] = []  # chunks taken from the inbox, not yet run (this thread's)
        self.failure: BaseException | None = None  # what ended the thread, if something did

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish what is queued, then end the thread."""
        if self._thread.is_alive():
            self.inbox.put(None)
            self._thread.join()

    @property
    def alive(self) -> bool:
        """Started, and not ended by a failure (a stopped lane is not alive either)."""
        return self._thread.is_alive() and self.failure is None

    def _run(self) -> None:
        try:
            device = self._backend.device
            if device.type != "cuda":
                self._serve()
                return
            # Other lanes and the LLM engine keep the GPU busy on their own streams meanwhile.
            with torch.cuda.stream(torch.cuda.Stream(device)):
                self._serve()
        except BaseException as exc:  # noqa: BLE001 - whatever kills the thread fails its work, not the process
            self.failure = exc
            logger.critical("token2wav thread %s died: %s", self._thread.name, type(exc).__name__,
                            exc_info=exc)
            self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every chunk and call this dead lane still holds or is sent later (see `Token2WavWorker`)."""
        error = _died(exc)
        items: list[_ChunkTask | _Call | None] = list(self._pending)
        self._pending.clear()
        self._drain(items)
        for item in items:
            future = item.future if isinstance(item, _ChunkTask | _Call) else None
            if future is not None and not future.done():
                future.set_exception(error)

    def _serve(self) -> None:
        pending = self._pending
        while True:
            items = [self.inbox.get()] if not pending else []
            self._drain(items)
            self._take_chunks(items, pending)
            if self.fresh and len(pending) < self._max_batch and any(c.due == -math.inf for c in pending):
                items += self._linger()
                self._take_chunks(items, pending)
            calls = [item for item in items if isinstance(item, _Call)]
            stop = any(item is None for item in items)
            pending[:] = [chunk for chunk in pending if not chunk.future.cancelled()]
            pending.sort(key=lambda chunk: chunk.urgency)
            batch = pending[: self._max_batch]
            del pending[: self._max_batch]
            self._run_chunks(batch)
            for call in calls:
                self._run_call(call)
            if stop:
                while pending:
                    batch = pending[: self._max_batch]
                    del pending[: self._max_batch]
                    self._run_chunks(batch)
                return

    def _drain(self, items: list[_ChunkTask | _Call | None]) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self.inbox.get_nowait())

    def _take_chunks(self, items: list[_ChunkTask | _Call | None], pending: list[_ChunkTask]) -> None:
        """Move the chunks among `items` to `pending` (their streams are no longer fresh)."""
        for item in items:
            if isinstance(item, _ChunkTask):
                self.fresh.discard(item.job.stream)
                pending.append(item)
        items[:] = [item for item in items if not isinstance(item, _ChunkTask)]

    def _linger(self) -> list[_ChunkTask | _Call | None]:
        """What arrives while fresh streams (opened here, no chunk yet) keep sending their first
        chunks (`FirstChunkLinger`), or until every one of them has: one batch of their first chunks
        is much cheaper than one after the other."""
        policy = self._linger_policy
        started = last_arrival = time.perf_counter()
        waiting_for = set(self.fresh)
        items: list[_ChunkTask | _Call | None] = []
        while waiting_for:
            left = min(last_arrival + policy.gap_s, started + policy.max_s) - time.perf_counter()
            if left <= 0:
                break
            try:
                items.append(self.inbox.get(timeout=left))
            except queue.Empty:
                break
            self._drain(items)
            still_waiting = len(waiting_for)
            waiting_for.difference_update(item.job.stream for item in items if isinstance(item, _ChunkTask))
            if len(waiting_for) < still_waiting:
                last_arrival = time.perf_counter()
        return items

    def _run_chunks(self, chunks: list[_ChunkTask]) -> None:
        live = [c for c in chunks if c.future.set_running_or_notify_cancel()]
        if not live:
            return
        started = time.perf_counter()
        try:
            results = self._backend.run_chunks([c.job for c in live])
            for chunk, audio in zip(live, results, strict=True):
                chunk.future.set_result(audio.detach().to("cpu", torch.float32).numpy())
            if self._metrics is not None:
                self._observe(live, started)
        except BaseException as exc:  # the backend failed this batch: every chunk in it fails
            if isinstance(exc, Exception):
                logger.exception("token2wav batch of %d chunks failed", len(live))
            for chunk in live:
                if not chunk.future.done():
                    chunk.future.set_exception(exc if isinstance(exc, Exception) else _died(exc))
            if not isinstance(exc, Exception):
                raise  # it ends the thread (see `_run`)

    def _observe(self, chunks: list[_ChunkTask], started: float) -> None:
        assert self._metrics is not None
        self._metrics.token2wav_batch_seconds.observe(time.perf_counter() - started)
        self._metrics.token2wav_batch_chunks.observe(len(chunks))
        for chunk in chunks:
            self._metrics.token2wav_wait_seconds.observe(started - chunk.submitted)

    def _run_call(self, call: _Call) -> None:
        if call.future is not None and not call.future.set_running_or_notify_cancel():
            return
        try:
            result = call.fn()
            if self._backend.device.type == "cuda":
                # What a call made (a speaker's state) may be read next on another lane's stream.
                torch.cuda.current_stream(self._backend.device).synchronize()
        except BaseException as exc:
            if call.future is None:
                logger.exception("token2wav call failed")
            elif not call.future.done():
                call.future.set_exception(exc if isinstance(exc, Exception) else _died(exc))
            if not isinstance(exc, Exception):
                raise  # it ends the thread (see `_run`)
            return
        if call.future is not None:
            call.future.set_result(result)

    def put(self, item: _ChunkTask | _Call) -> None:
        """Queue `item` for this lane's thread; once the thread has died it fails at once instead."""
        self.inbox.put(item)
        if self.failure is not None:
            self._fail_all(self.failure)


def _died(exc: BaseException) -> RuntimeError:
    return RuntimeError(f"the token2wav worker thread died ({type(exc).__name__})")


class Token2WavWorker:
    """The token2wav backend on `threads` threads. Thread-safe entry points; results as futures.

    A new stream goes to the thread with the fewest streams and stays there. Several threads run
    batches concurrently (on CUDA, each on its own stream); the backend must then be safe to call from
    several threads for distinct streams (the PyTorch backend is, without CUDA graphs).
    """

    def __init__(self, backend: Token2Wav, max_batch: int, capacity: int, threads: int = 1,
                 metrics: Metrics | None = None, linger: FirstChunkLinger = FirstChunkLinger(),
                 name: str = "token2wav") -> None:
        if threads < 1:
            raise ValueError(f"a token2wav worker needs at least one thread, got {threads}")
        self._backend = backend
        self._lanes = [_Lane(f"{name}-{i}", backend, max_batch, linger, metrics) for i in range(threads)]
        self._lane_of: dict[Token2WavStream, _Lane] = {}
        self._slots = asyncio.Semaphore(capacity)
        self._order = itertools.count()
        self._queued = 0

    @property
    def device(self) -> torch.device:
        return self._backend.device

    @property
    def alive(self) -> bool:
        """Every thread started and none has died (a worker with a dead thread takes no new streams;
        its streams' chunks fail at once)."""
        return all(lane.alive for lane in self._lanes)

    @property
    def open_streams(self) -> int:
        """Streams opened and not yet closed on the worker threads."""
        return sum(lane.open_streams for lane in self._lanes)

    @property
    def queue_depth(self) -> int:
        """Chunks submitted and not yet finished."""
        return self._queued

    def start(self) -> None:
        for lane in self._lanes:
            lane.start()

    def stop(self) -> None:
        """Finish what is queued, then end the threads."""
        for lane in self._lanes:
            lane.stop()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the first worker thread (between batches) and return its result."""
        return await self._call(self._lanes[0], fn)

    async def prepare_speaker(self, prompt: VoicePrompt) -> SpeakerState:
        return await self.call(lambda: self._backend.prepare_speaker(prompt))

    async def warmup(self, speaker: SpeakerState, batches: Sequence[int]) -> None:
        await self.call(lambda: self._backend.warmup(speaker, batches))

    async def open_stream(self, speaker: SpeakerState) -> Token2WavStream:
        lane = min(self._lanes, key=lambda candidate: candidate.assigned)

        def open_() -> Token2WavStream:
            stream = self._backend.open_stream(speaker)
            lane.open_streams += 1
            lane.fresh.add(stream)
            return stream

        lane.assigned += 1
        try:
            stream = await self._call(lane, open_)
        except BaseException:
            lane.assigned -= 1
            raise
        self._lane_of[stream] = lane
        return stream

    def close_stream(self, stream: Token2WavStream) -> None:
        lane = self._lane_of.pop(stream)
        lane.assigned -= 1

        def close() -> None:
            stream.close()
            lane.open_streams -= 1
            lane.fresh.discard(stream)

        lane.put(_Call(close, None))

    async def synthesize(
        self, stream: Token2WavStream, tokens: Sequence[int], last: bool, due: float
    ) -> np.ndarray:
        """Audio of one chunk, scheduled by `due`; waits while `capacity` chunks are already queued.
        Call from the loop."""
        lane = self._lane_of[stream]
        job = ChunkJob(stream, torch.tensor(list(tokens), dtype=torch.int64), last)
        async with self._slots:
            future: Future[np.ndarray] = Future()
            self._queued += 1
            lane.put(_ChunkTask(job, due, future, next(self._order)))
            try:
                return await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                future.cancel()  # the worker skips it if it has not started yet
                raise
            finally:
                self._queued -= 1

    @staticmethod
    async def _call(lane: _Lane, fn: Callable[[], T]) -> T:
        future: Future[T] = Future()
        lane.put(_Call(fn, future))
        return await asyncio.wrap_future(future)


__all__ = ["FirstChunkLinger", "Token2WavWorker"]
