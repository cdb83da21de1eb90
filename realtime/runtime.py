"""The runtime owns the engines, their threads and the asyncio bridge to them.

- The LLM engine runs its own loop (its thread); sessions submit requests and iterate token streams.
- token2wav runs on dedicated worker threads (`Token2WavWorker`; one by default, a small pool in the
  benchmark's baseline). Sessions hand it chunks through a bounded queue and await futures; each turn
  a thread runs the `max_batch` most urgent of the chunks waiting for it (earliest deadline first:
  first audio before everything, then the chunk whose listener runs out of audio soonest) with one
  `run_chunks` call, the point where a GPU backend batches streams. A stream is opened, run and
  closed on one thread, so its chunks keep their order and its tensors stay on that thread's CUDA
  stream.
- `speak` validates a request, asks the admission policy, and returns a `Session` (session.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from engines.config import ModelPaths
from engines.llm.auto import select_llm
from engines.llm.base import LLMEngine, LLMError, LLMRequest, SamplingParams, TokenStream
from engines.text import TextError, TextFrontend
from engines.token2wav.auto import select_token2wav
from engines.token2wav.base import ChunkJob, SpeakerState, Token2Wav, Token2WavStream
from engines.voice import VoicePrompt
from engines.voice_encoder import VoiceEncoder, VoiceError, VoiceLimits
from realtime.admission import AdmissionPolicy, Load, Refuse
from realtime.config import ServiceConfig
from realtime.metrics import Metrics
from realtime.session import PreparedVoice, Segment, ServiceError, Session, SpeechRequest
from realtime.voices import VoiceInfo, VoiceRegistry, check_voice_id

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Text tokens per LLM request when long text is cut into segments.
SEGMENT_TOKENS = 80


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

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish what is queued, then end the thread."""
        if self._thread.is_alive():
            self.inbox.put(None)
            self._thread.join()

    def _run(self) -> None:
        device = self._backend.device
        if device.type != "cuda":
            self._serve()
            return
        # Other lanes and the LLM engine keep the GPU busy on their own streams meanwhile.
        with torch.cuda.stream(torch.cuda.Stream(device)):
            self._serve()

    def _serve(self) -> None:
        pending: list[_ChunkTask] = []
        while True:
            items = [self.inbox.get()] if not pending else []
            self._drain(items)
            self._take_chunks(items, pending)
            if self.fresh and len(pending) < self._max_batch and any(c.due == -math.inf for c in pending):
                items += self._linger()
                self._take_chunks(items, pending)
            calls = [item for item in items if isinstance(item, _Call)]
            stop = any(item is None for item in items)
            pending = [chunk for chunk in pending if not chunk.future.cancelled()]
            pending.sort(key=lambda chunk: chunk.urgency)
            batch, pending = pending[: self._max_batch], pending[self._max_batch :]
            self._run_chunks(batch)
            for call in calls:
                self._run_call(call)
            if stop:
                while pending:
                    batch, pending = pending[: self._max_batch], pending[self._max_batch :]
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
        except Exception as exc:  # the backend failed this batch: every chunk in it fails
            logger.exception("token2wav batch of %d chunks failed", len(live))
            for chunk in live:
                if not chunk.future.done():
                    chunk.future.set_exception(exc)

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
        except Exception as exc:
            if call.future is None:
                logger.exception("token2wav call failed")
            else:
                call.future.set_exception(exc)
            return
        if call.future is not None:
            call.future.set_result(result)


class Token2WavWorker:
    """The token2wav backend on `threads` threads. Thread-safe entry points; results as futures.

    A new stream goes to the thread with the fewest streams and stays there. Several threads run
    batches concurrently (on CUDA, each on its own stream); the backend must then be safe to call from
    several threads for distinct streams (the PyTorch backend is, without CUDA graphs).
    """

    def __init__(self, backend: Token2Wav, max_batch: int, capacity: int, threads: int = 1,
                 metrics: Metrics | None = None, linger: FirstChunkLinger = FirstChunkLinger()) -> None:
        if threads < 1:
            raise ValueError(f"a token2wav worker needs at least one thread, got {threads}")
        self._backend = backend
        self._lanes = [_Lane(f"token2wav-{i}", backend, max_batch, linger, metrics) for i in range(threads)]
        self._lane_of: dict[Token2WavStream, _Lane] = {}
        self._slots = asyncio.Semaphore(capacity)
        self._order = itertools.count()
        self._queued = 0

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

        lane.inbox.put(_Call(close, None))

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
            lane.inbox.put(_ChunkTask(job, due, future, next(self._order)))
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
        lane.inbox.put(_Call(fn, future))
        return await asyncio.wrap_future(future)


@dataclass(frozen=True)
class RuntimeStats:
    """What tests and `/metrics` read: admitted streams and what the engines hold."""

    active_streams: int
    llm_active: int
    llm_waiting: int
    token2wav_streams: int
    token2wav_queue: int


@dataclass(frozen=True)
class LoadedEngines:
    """The engines of one models directory, constructed but not started."""

    llm: LLMEngine
    token2wav: Token2Wav
    text: TextFrontend
    voice_encoder: VoiceEncoder


def load_engines(config: ServiceConfig) -> LoadedEngines:
    """The engines over `config.models_dir`, backends picked by engines/*/auto.py (blocking: call it off
    the event loop). RuntimeError says why a backend asked for by name cannot run."""
    device = config.torch_device
    token2wav = select_token2wav(
        config.models_dir,
        config.token2wav_backend,
        config.flow,
        device,
        pool_size=max(4, config.token2wav_workers),
        # CUDA graphs replay from shared buffers: only one thread may run the backend with them.
        cuda_graphs=config.token2wav_workers == 1,
    )
    slots = config.llm_slots or config.max_streams
    llm = select_llm(config.models_dir, config.llm_backend, device, max_slots=slots)
    if llm.stats().max_slots != slots:
        logger.warning("the %s LLM engine batches up to %d requests, not %d", llm.name, llm.stats().max_slots,
                       slots)
    paths = ModelPaths(config.models_dir)
    text = TextFrontend(paths.text_tokenizer, max_text_chars=config.max_text_chars)
    encoder = VoiceEncoder(
        paths.speech_tokenizer,
        paths.campplus,
        device="cpu" if device == "cpu" else "auto",
        limits=VoiceLimits(max_seconds=config.max_voice_upload_s),
    )
    return LoadedEngines(llm, token2wav, text, encoder)


class Runtime:
    """Owns the engines; `speak` turns a `SpeechRequest` into a `Session` of audio chunks.

    Constructing it is cheap; `start()` loads the engines (through `loader`) and the voices.
    """

    def __init__(
        self,
        config: ServiceConfig,
        loader: Callable[[ServiceConfig], LoadedEngines] = load_engines,
    ) -> None:
        self.config = config
        self.voices = VoiceRegistry(
            config.voice_store, ModelPaths(config.models_dir).voices / "default.safetensors"
        )
        self.metrics = Metrics()
        self._loader = loader
        self._engines: LoadedEngines | None = None
        self._worker: Token2WavWorker | None = None
        self._admission = AdmissionPolicy.for_streams(config.max_streams, config.retry_after_s)
        self._prepared: dict[str, PreparedVoice] = {}
        self._sessions: set[Session] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = False
        # Read when scraped rather than kept in step by hand.
        self.metrics.active_streams.set_function(lambda: len(self._sessions))
        self.metrics.queue_depth.set_function(lambda: 0 if self._worker is None else self._worker.queue_depth)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load and start the engines, load the voices and prepare each one for synthesis."""
        engines = await asyncio.to_thread(self._loader, self.config)
        await engines.llm.start()
        worker = Token2WavWorker(
            engines.token2wav,
            self.config.token2wav_batch,
            capacity=2 * self.config.max_streams,
            threads=self.config.token2wav_workers,
            metrics=self.metrics,
        )
        worker.start()
        self._engines, self._worker = engines, worker
        device = engines.token2wav.device
        if device.type == "cuda":
            self.metrics.track_gpu_memory_peak(lambda: torch.cuda.max_memory_allocated(device))
        self.metrics.track_llm(engines.llm.stats)
        await asyncio.to_thread(self.voices.load)
        for info in self.voices.list():
            await self._prepare(info.voice_id, self.voices.get(info.voice_id))
        if device.type == "cuda" and "default" in self._prepared:
            await self._warm_up(worker, self._prepared["default"].speaker)
        self._accepting = True
        logger.info(
            "runtime ready: llm %s, token2wav %s, %d voices",
            engines.llm.name,
            engines.token2wav.name,
            len(self._prepared),
        )

    async def _warm_up(self, worker: Token2WavWorker, speaker: SpeakerState) -> None:
        """Run the schedule's chunk shapes at every batch size up to the configured one, so that the
        first requests do not pay for CUDA-graph capture or compilation. Then the process stops
        compiling: a shape the warm-up did not meet (a voice with a longer prompt, say) runs uncompiled
        rather than stalling every stream of the engine thread for the seconds Inductor takes."""
        batches = [1 << i for i in range(self.config.token2wav_batch.bit_length())]
        started = time.perf_counter()
        await worker.warmup(speaker, batches)
        torch.compiler.set_stance("eager_on_recompile")
        logger.info("token2wav warmed up for batches %s in %.1f s; compilation closed", batches,
                    time.perf_counter() - started)

    async def stop(self, drain_timeout_s: float) -> None:
        """Refuse new streams, let running ones finish for up to `drain_timeout_s`, cancel the rest."""
        self._accepting = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        if self._sessions:
            logger.warning(
                "cancelling %d streams still running after %.1f s", len(self._sessions), drain_timeout_s
            )
        for session in list(self._sessions):
            await session.aclose()
        if self._engines is not None:
            await self._engines.llm.stop()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.stop)

    @property
    def ready(self) -> bool:
        return self._accepting

    def stats(self) -> RuntimeStats:
        engines, worker = self._running()
        llm = engines.llm.stats()
        return RuntimeStats(
            len(self._sessions), llm.active, llm.waiting, worker.open_streams, worker.queue_depth
        )

    def _running(self) -> tuple[LoadedEngines, Token2WavWorker]:
        if self._engines is None or self._worker is None:
            raise ServiceError("not_ready", "the server is still starting", 503, self.config.retry_after_s)
        return self._engines, self._worker

    # -- synthesis -----------------------------------------------------------------------------

    def speak(self, request: SpeechRequest) -> Session:
        """A session for `request`, admitted now; raises ServiceError when it cannot be served."""
        with self._counting_errors():
            return self._admit(request)

    @contextlib.contextmanager
    def _counting_errors(self) -> Iterator[None]:
        try:
            yield
        except ServiceError as exc:
            self.metrics.error(exc.code)
            raise

    def _admit(self, request: SpeechRequest) -> Session:
        if not self._accepting:
            raise ServiceError("shutting_down", "the server is shutting down", 503, self.config.retry_after_s)
        engines, worker = self._running()
        voice = self._voice(request.voice)
        segments = self._segments(request.text)
        stats = self.stats()
        decision = self._admission.decide(
            Load(stats.active_streams, stats.llm_waiting, stats.token2wav_queue)
        )
        if isinstance(decision, Refuse):
            raise ServiceError("busy", decision.reason, 429, decision.retry_after_s)
        session_id = secrets.token_hex(4)
        session: Session

        def release() -> None:
            self._sessions.discard(session)
            self._track_sessions()

        session = Session(
            session_id,
            request,
            voice,
            segments,
            _Engines(engines.llm, worker),
            self.metrics,
            self.config.chunk_queue,
            on_close=release,
            pace_llm=self.config.llm_pacing,
            schedule=self.config.schedule,
        )
        self._sessions.add(session)
        self._track_sessions()
        logger.info(
            "[%s] admitted: voice %s, %d segments, %d chars",
            session_id,
            request.voice,
            len(segments),
            len(request.text),
        )
        return session

    def _voice(self, voice_id: str) -> PreparedVoice:
        voice = self._prepared.get(voice_id)
        if voice is None:
            raise ServiceError("voice_not_found", f"there is no voice {voice_id!r}", 404)
        return voice

    def _segments(self, text: str) -> list[Segment]:
        """`text` cut into LLM requests, or ServiceError (`text_too_long`, `empty_text`, ...)."""
        engines, _ = self._running()
        try:
            pieces = engines.text.split_segments(text, SEGMENT_TOKENS)
            return [Segment(piece, tuple(engines.text.encode(piece))) for piece in pieces]
        except TextError as exc:
            raise ServiceError(exc.code, str(exc), 400) from exc

    # -- offline synthesis ---------------------------------------------------------------------

    async def render(self, text: str, voice: str, sampling: SamplingParams) -> np.ndarray:
        """The whole utterance at once (offline, no admission): 24 kHz float32 audio.

        Every segment's LLM request is submitted at once; each segment's tokens then go to token2wav as
        one final chunk, which the worker batches with the chunks of other renders. Cancelling frees
        the LLM requests and token2wav streams. Raises ServiceError.
        """
        with self._counting_errors():
            engines, worker = self._running()
            prepared = self._voice(voice)
            render_id = secrets.token_hex(4)
            token_streams: list[TokenStream] = []
            try:
                for index, segment in enumerate(self._segments(text)):
                    request = LLMRequest(
                        request_id=f"{render_id}-{index}",
                        text_ids=segment.text_ids,
                        prompt_text_ids=prepared.prompt_text_ids,
                        prompt_speech_tokens=prepared.prompt_speech_tokens,
                        sampling=sampling,
                    )
                    token_streams.append(engines.llm.submit(request))
                pieces = [await self._render_segment(worker, prepared, tokens) for tokens in token_streams]
            except LLMError as exc:
                raise ServiceError(exc.code, str(exc), 500) from exc
            finally:
                for token_stream in token_streams:
                    token_stream.cancel()
        return np.concatenate(pieces)

    @staticmethod
    async def _render_segment(
        worker: Token2WavWorker, voice: PreparedVoice, token_stream: TokenStream
    ) -> np.ndarray:
        tokens = [token async for batch in token_stream for token in batch]
        if not tokens:
            return np.zeros(0, dtype=np.float32)
        stream = await worker.open_stream(voice.speaker)
        try:
            return await worker.synthesize(stream, tokens, last=True, due=-math.inf)
        finally:
            worker.close_stream(stream)

    def _track_sessions(self) -> None:
        if self._sessions:
            self._idle.clear()
        else:
            self._idle.set()

    # -- voices --------------------------------------------------------------------------------

    async def add_voice(self, voice_id: str, audio: bytes, transcript: str) -> VoiceInfo:
        """Extract a voice from a reference clip and its transcript, store it and make it usable."""
        with self._counting_errors():
            return await self._add_voice(voice_id, audio, transcript)

    async def _add_voice(self, voice_id: str, audio: bytes, transcript: str) -> VoiceInfo:
        engines, _ = self._running()
        check_voice_id(voice_id)
        if voice_id in self.voices:
            raise ServiceError("voice_exists", f"a voice {voice_id!r} already exists; delete it first", 409)
        try:
            prompt = await asyncio.to_thread(engines.voice_encoder.encode, audio, transcript)
        except VoiceError as exc:
            raise ServiceError(exc.code, str(exc), 400) from exc
        await self._prepare(voice_id, prompt)
        try:
            return await asyncio.to_thread(self.voices.add, voice_id, prompt)
        except BaseException:
            self._prepared.pop(voice_id, None)
            raise

    async def remove_voice(self, voice_id: str) -> None:
        with self._counting_errors():
            await asyncio.to_thread(self.voices.remove, voice_id)
        self._prepared.pop(voice_id, None)

    async def _prepare(self, voice_id: str, prompt: VoicePrompt) -> None:
        engines, worker = self._running()
        speaker = await worker.prepare_speaker(prompt)
        self._prepared[voice_id] = PreparedVoice(
            voice_id=voice_id,
            prompt_text_ids=tuple(engines.text.encode(prompt.prompt_text)),
            prompt_speech_tokens=tuple(int(t) for t in prompt.speech_tokens.tolist()),
            speaker=speaker,
        )


@dataclass(frozen=True)
class _Engines:
    """The `session.Engines` a session sees: the LLM and the token2wav worker."""

    llm: LLMEngine
    worker: Token2WavWorker

    def submit_llm(self, request: LLMRequest) -> TokenStream:
        return self.llm.submit(request)

    async def open_stream(self, speaker: SpeakerState) -> Token2WavStream:
        return await self.worker.open_stream(speaker)

    async def synthesize(
        self, stream: Token2WavStream, tokens: Sequence[int], last: bool, due: float
    ) -> np.ndarray:
        return await self.worker.synthesize(stream, tokens, last, due)

    def close_stream(self, stream: Token2WavStream) -> None:
        self.worker.close_stream(stream)


__all__ = ["Runtime", "RuntimeStats", "ServiceError", "Token2WavWorker"]
