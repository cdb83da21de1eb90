"""token2wav worker threads: the bridge between sessions on the event loop and a token2wav backend.

Sessions hand chunks to a `Token2WavWorker` with a deadline and await futures; each turn a worker
thread asks its `BatchPolicy` (realtime/batch_policy.py: first audio alone and together, then earliest
deadline first) which waiting chunks go into the next `launch_chunks` call, the point where a GPU
backend batches streams, or how long to hold for more first chunks. A stream is opened, run and closed
on one thread, so its chunks keep their order and its tensors stay on that thread's CUDA stream.

Each call is launched (`launch_chunks`: the host's bookkeeping and launches) and then waited for; the
metrics keep the two apart, which tells whether the host or the device is the slower side. Queueing
the next call before waiting for the last one was measured worse (docs/benchmarks.md, tenth session).
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

from engines.token2wav.base import ChunkJob, SpeakerState, Token2Wav, Token2WavStream, WarmupSteps
from engines.voice import VoicePrompt
from realtime.batch_policy import BatchPolicy, FirstChunkHold, RecentStepTime, WaitingChunk
from realtime.metrics import Metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DONE = object()  # what `next` returns for exhausted warm-up steps
# While streams are open on a thread, at most one warm-up step per this many seconds runs there.
WARMUP_STEP_GAP_S = 1.0


@dataclass
class _ChunkTask:
    job: ChunkJob
    due: float  # when the listener needs this chunk; earliest first
    future: Future[np.ndarray]
    order: int  # arrival order, breaks ties between equal deadlines
    submitted: float = field(default_factory=time.monotonic)

    @property
    def waiting(self) -> WaitingChunk:
        return WaitingChunk(self.due, self.order, self.submitted, self.job.tokens.numel())


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future[Any] | None


class _Lane:
    """One token2wav thread with its own inbox (and its own CUDA stream on CUDA).

    Each turn it moves everything in its inbox to its pending chunks and calls, drops cancelled chunks,
    and runs the chunks its `BatchPolicy` picks in one `launch_chunks` call, waiting for their audio,
    then the calls; when the policy holds for more first chunks, it runs the calls (opening the streams
    whose first chunks it waits for) and waits for the inbox until the hold ends. A stream's close is
    only queued once its chunk is finished or cancelled, and cancelled chunks are dropped before the
    calls run, so a close never overtakes a chunk of its stream.
    """

    def __init__(self, name: str, backend: Token2Wav, policy: BatchPolicy, metrics: Metrics | None,
                 llm_steps: Callable[[], tuple[int, float]] | None) -> None:
        self.inbox: queue.SimpleQueue[_ChunkTask | _Call | None] = queue.SimpleQueue()
        self.assigned = 0  # streams routed here and not yet closed (event loop side)
        self.open_streams = 0  # streams opened here and not yet closed (this thread's side)
        # Streams opened here for a listener's first audio whose first chunk has not come yet (this
        # thread's side): the first-audio calls wait for them.
        self.fresh: set[Token2WavStream] = set()
        self._policy = policy
        self._llm_steps = llm_steps
        self._llm_step = RecentStepTime()
        # This thread's recent token2wav call, which the policy weighs later chunks' deadlines against.
        self._call_time = RecentStepTime()
        self._backend = backend
        self._device = backend.device  # fixed once loaded; the property walks the model's parameters
        self._metrics = metrics
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._pending: list[_ChunkTask] = []  # chunks taken from the inbox, not yet run (this thread's)
        # The rest of a staged warm-up (Token2Wav.staged_warmup), a step whenever nothing is queued.
        self._warmup_steps: WarmupSteps | None = None
        self._last_step = -math.inf  # when the last warm-up step ended (time.monotonic)
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
            device = self._device
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
        finally:
            self._end_warmup_steps()

    @property
    def warming_up(self) -> bool:
        return self._warmup_steps is not None

    def warm_up_between_calls(self, steps: WarmupSteps) -> None:
        """Run `steps` (the rest of a staged warm-up) when nothing is queued (`_receive`), instead of the
        rest of an earlier one. On this thread."""
        self._end_warmup_steps()
        self._warmup_steps = steps
        if self._metrics is not None:
            self._metrics.token2wav_warmups_running.inc()

    def _warmup_step(self) -> None:
        """One step of the warm-up's rest; the warm-up ends when they are exhausted or one fails (shapes it
        did not capture then run eagerly: the service goes on)."""
        assert self._warmup_steps is not None
        started = time.monotonic()
        try:
            more = next(self._warmup_steps, _DONE) is not _DONE
        except Exception:
            logger.exception("token2wav warm-up step failed; the shapes it did not reach run eagerly")
            more = False
        self._last_step = time.monotonic()
        if self._metrics is not None:
            self._metrics.token2wav_warmup_step_seconds.observe(self._last_step - started)
        if not more:
            self._end_warmup_steps()

    def _end_warmup_steps(self) -> None:
        steps, self._warmup_steps = self._warmup_steps, None
        if steps is None:
            return
        try:
            steps.close()  # left mid-way (a stop): what the step in progress holds (its streams) goes
        except Exception:  # the service goes on without the rest of the warm-up
            logger.exception("ending the token2wav warm-up's steps failed")
        finally:
            if self._metrics is not None:
                self._metrics.token2wav_warmups_running.dec()

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
        hold_until: float | None = None
        while True:
            items = self._receive(hold_until)
            for item in items:
                if isinstance(item, _ChunkTask):
                    self.fresh.discard(item.job.stream)
                    pending.append(item)
            calls = [item for item in items if isinstance(item, _Call)]
            stop = any(item is None for item in items)
            pending[:] = [chunk for chunk in pending if not chunk.future.cancelled()]
            expected = 0 if stop else len(self.fresh)
            decision = self._policy.decide([chunk.waiting for chunk in pending], expected,
                                           time.monotonic(), self._recent_llm_step() if expected else 0.0,
                                           self._call_time.seconds)
            hold_until = decision.hold_until
            self._run_chunks(self._take(decision.run), expected)
            for call in calls:
                self._run_call(call)
            if stop:
                while pending:
                    decision = self._policy.decide([chunk.waiting for chunk in pending], 0, math.inf)
                    self._run_chunks(self._take(decision.run))
                return

    def _receive(self, hold_until: float | None) -> list[_ChunkTask | _Call | None]:
        """Everything in the inbox: with no chunk pending, block for the first item (or, with warm-up steps
        left, run one once nothing came (beside open streams: nothing for `WARMUP_STEP_GAP_S` since the
        last) and return none); while holding (`hold_until`), wait for one until then; else take only
        what is there."""
        items: list[_ChunkTask | _Call | None] = []
        if not self._pending and self._warmup_steps is not None:
            # Back to back while no stream is open; beside open streams one step per gap at most: a step
            # delays their next chunks and, holding the GIL, the LLM's steps (docs/benchmarks.md,
            # twentieth session), but must not wait for a lull that steady traffic never leaves.
            wait = 0.0 if not self.open_streams else self._last_step + WARMUP_STEP_GAP_S - time.monotonic()
            if self.fresh:  # a new stream's first chunk is coming: it goes first
                wait = max(wait, WARMUP_STEP_GAP_S)
            try:
                items.append(self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait())
            except queue.Empty:
                self._warmup_step()
                return items
        elif not self._pending:
            items.append(self.inbox.get())
        elif hold_until is not None:
            with contextlib.suppress(queue.Empty):
                items.append(self.inbox.get(timeout=max(0.0, hold_until - time.monotonic())))
        self._drain(items)
        return items

    def _recent_llm_step(self) -> float:
        """The LLM's recent decode step in seconds (0: unknown), read only while first chunks are due."""
        return 0.0 if self._llm_steps is None else self._llm_step.read(*self._llm_steps())

    def _take(self, indices: Sequence[int]) -> list[_ChunkTask]:
        """Remove the pending chunks at `indices` and return them in that order."""
        chosen = [self._pending[i] for i in indices]
        taken = set(indices)
        self._pending[:] = [chunk for i, chunk in enumerate(self._pending) if i not in taken]
        return chosen

    def _drain(self, items: list[_ChunkTask | _Call | None]) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self.inbox.get_nowait())

    def _run_chunks(self, chunks: list[_ChunkTask], expected_first: int = 0) -> None:
        """Run the chunks that are not cancelled as one call and hand out their audio (`expected_first`:
        new streams whose first chunk has not come yet, for the metrics)."""
        live = [c for c in chunks if c.future.set_running_or_notify_cancel()]
        if not live:
            return
        started = time.monotonic()
        try:
            audio = self._backend.launch_chunks([c.job for c in live])
            launched = time.monotonic()
            results = audio.wait()
            for chunk, piece in zip(live, results, strict=True):
                chunk.future.set_result(piece.detach().to("cpu", torch.float32).numpy())
            finished = time.monotonic()
            self._call_time.record(finished - started)
            if self._metrics is not None:
                self._observe(live, started, finished - started, launched - started, finished - launched,
                              expected_first)
        except BaseException as exc:  # the backend failed this batch: every chunk in it fails
            if isinstance(exc, Exception):
                logger.exception("token2wav batch of %d chunks failed", len(live))
            for chunk in live:
                if not chunk.future.done():
                    chunk.future.set_exception(exc if isinstance(exc, Exception) else _died(exc))
            if not isinstance(exc, Exception):
                raise  # it ends the thread (see `_run`)

    def _observe(self, chunks: list[_ChunkTask], started: float, elapsed: float, launch: float,
                 waited: float, expected_first: int) -> None:
        assert self._metrics is not None
        self._metrics.token2wav_batch_seconds.observe(elapsed)
        self._metrics.token2wav_launch_seconds.observe(launch)
        self._metrics.token2wav_device_wait_seconds.observe(waited)
        self._metrics.token2wav_batch_chunks.observe(len(chunks))
        firsts = sum(chunk.waiting.first for chunk in chunks)
        if firsts:
            self._metrics.token2wav_batch_first_chunks.observe(firsts)
            self._metrics.token2wav_first_chunks_pending.observe(expected_first)
        ready = started + elapsed
        for chunk in chunks:
            self._metrics.chunk_waited(chunk.waiting.first, started - chunk.submitted)
            if math.isfinite(chunk.due):  # a later chunk (first audio is due at once: -inf)
                self._metrics.later_chunk_ready(chunk.due, chunk.submitted, ready)

    def _run_call(self, call: _Call) -> None:
        if call.future is not None and not call.future.set_running_or_notify_cancel():
            return
        try:
            result = call.fn()
            if self._device.type == "cuda":
                # What a call made (a speaker's state) may be read next on another lane's stream.
                torch.cuda.current_stream(self._device).synchronize()
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


def _close_on(lane: _Lane, stream: Token2WavStream) -> None:
    """Queue the close of `stream` on `lane`, the thread that opened it."""

    def close() -> None:
        stream.close()
        lane.open_streams -= 1
        lane.fresh.discard(stream)

    lane.put(_Call(close, None))


def _close_opened(lane: _Lane, opened: Future[Token2WavStream]) -> None:
    """Close the stream `opened` brought, if it brought one (its opener was gone by then)."""
    if not opened.cancelled() and opened.exception() is None:
        _close_on(lane, opened.result())


def _died(exc: BaseException) -> RuntimeError:
    return RuntimeError(f"the token2wav worker thread died ({type(exc).__name__})")


class Token2WavWorker:
    """The token2wav backend on `threads` threads. Thread-safe entry points; results as futures.

    A new stream goes to the thread with the fewest streams and stays there. Several threads run
    batches concurrently (on CUDA, each on its own stream); the backend must then be safe to call from
    several threads for distinct streams (the PyTorch backend is, without CUDA graphs).

    `hold`: how new streams' first chunks wait for each other (`BatchPolicy`); `llm_steps`: the LLM
    engines' cumulative decode steps and step seconds (`LLMStats`), from which the hold's gap follows
    the recent step time (read on the worker threads, only while new streams' first chunks are due);
    `max_call_tokens`: the most speech tokens in one call (`BatchPolicy.max_tokens`); `urgent_calls`:
    `BatchPolicy.urgent_calls`.
    """

    def __init__(self, backend: Token2Wav, max_batch: int, capacity: int, threads: int = 1,
                 metrics: Metrics | None = None, hold: FirstChunkHold | None = None,
                 llm_steps: Callable[[], tuple[int, float]] | None = None, name: str = "token2wav",
                 max_call_tokens: int | None = None, urgent_calls: float = 2.0) -> None:
        if threads < 1:
            raise ValueError(f"a token2wav worker needs at least one thread, got {threads}")
        self._backend = backend
        self.device: torch.device = backend.device  # fixed once loaded; the backend's walks its parameters
        policy = BatchPolicy(max_batch, hold or FirstChunkHold(), max_call_tokens, urgent_calls)
        self._lanes = [_Lane(f"{name}-{i}", backend, policy, metrics, llm_steps) for i in range(threads)]
        self._lane_of: dict[Token2WavStream, _Lane] = {}
        self._slots = asyncio.Semaphore(capacity)
        self._order = itertools.count()
        self._queued = 0

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
    def warming_up(self) -> bool:
        """Whether a warm-up still runs between calls (`warmup(between_calls=True)`)."""
        return any(lane.warming_up for lane in self._lanes)

    @property
    def queue_depth(self) -> int:
        """Chunks submitted and not yet finished."""
        return self._queued

    def start(self) -> None:
        for lane in self._lanes:
            lane.start()

    def stop(self) -> None:
        """Finish what is queued, then end the threads and release what the backend holds beside its
        streams (`Token2Wav.close`)."""
        for lane in self._lanes:
            lane.stop()
        self._backend.close()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the first worker thread (between batches) and return its result."""
        return await self._call(self._lanes[0], fn)

    async def prepare_speaker(self, prompt: VoicePrompt) -> SpeakerState:
        return await self.call(lambda: self._backend.prepare_speaker(prompt))

    async def prepare_warmup(self, speaker: SpeakerState, batches: Sequence[int]) -> None:
        await self.call(lambda: self._backend.prepare_warmup(speaker, batches))

    async def warmup(self, speaker: SpeakerState, batches: Sequence[int],
                     between_calls: bool = False) -> None:
        """The backend's warm-up. `between_calls`: return after its first stage (`Token2Wav.staged_warmup`)
        and run the rest on the first thread when it has nothing queued (beside open streams at most one
        step per `WARMUP_STEP_GAP_S`)."""
        lane = self._lanes[0]

        def first_stage() -> None:
            steps = self._backend.staged_warmup(speaker, batches)
            next(steps, None)
            if between_calls:
                lane.warm_up_between_calls(steps)
            else:
                for _ in steps:
                    pass

        await self._call(lane, first_stage)

    async def release_warmup(self) -> None:
        """No warm-up is coming: `Token2Wav.release_warmup`."""
        await self.call(self._backend.release_warmup)

    async def open_stream(self, speaker: SpeakerState, first_audio: bool = True) -> Token2WavStream:
        """A stream on the least loaded lane; `first_audio`: its first chunk is its listener's first audio,
        which the lane's first-audio calls wait for (a later text or segment to a listener that has audio
        already is not: its chunks have deadlines)."""
        lane = min(self._lanes, key=lambda candidate: candidate.assigned)

        def open_() -> Token2WavStream:
            stream = self._backend.open_stream(speaker)
            lane.open_streams += 1
            if first_audio:
                lane.fresh.add(stream)
            return stream

        lane.assigned += 1
        opened: Future[Token2WavStream] = Future()
        lane.put(_Call(open_, opened))
        try:
            stream = await asyncio.wrap_future(opened)
        except BaseException:
            lane.assigned -= 1
            # Cancelled while the thread was opening it: the stream opens all the same and is closed
            # there, else it would keep its caches and stay a fresh stream whose first chunk the batch
            # policy holds for.
            opened.add_done_callback(lambda done: _close_opened(lane, done))
            raise
        self._lane_of[stream] = lane
        return stream

    def close_stream(self, stream: Token2WavStream) -> None:
        lane = self._lane_of.pop(stream)
        lane.assigned -= 1
        _close_on(lane, stream)

    async def synthesize(
        self, stream: Token2WavStream, tokens: Sequence[int], last: bool, due: float
    ) -> np.ndarray:
        """Audio of one chunk, scheduled by `due` (on `time.monotonic`'s clock; -inf for a first chunk);
        waits while `capacity` chunks are already queued. Call from the loop."""
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


__all__ = ["Token2WavWorker"]
