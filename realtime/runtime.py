"""The runtime owns the engines, their threads and the asyncio bridge to them.

- The engines come from `load_engines` (realtime/engine_loader.py); `start()` starts them, warms them
  up and prepares every voice.
- Each LLM engine runs its own loop (its thread); sessions submit requests and iterate token streams.
- token2wav runs on one `Token2WavWorker` per token2wav device (realtime/token2wav_worker.py; one
  thread each, a small pool in the benchmark's baseline); a new session is placed on the worker with the
  most room, in streams and in device bytes: each stream reserves the most its token2wav state can
  reach (engines/token2wav/stream_memory.py) against its worker's budget (realtime/memory_budget.py: on
  CUDA, what is free after the warm-up less a margin) until it ends, so a stream that could not fit is
  refused `busy` instead of running a batch out of memory.
- `open_session` (what transports call) loads a voice another replica stored in the shared directory,
  then `speak` validates the request, asks the admission policy and returns a `Session` (session.py),
  whose text is cut into segments before `open_session` returns.
- Voices: uploads, deletes and a periodic sync with the voices directory (`--voice-sync`).
- Shutdown: `begin_drain` refuses new work (`shutting_down`) while accepted work finishes; `stop`
  cancels what is left after the drain timeout and stops the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engines.config import ModelPaths
from engines.cuda_graphs import empty_cache, free_bytes
from engines.llm.base import (
    LLMEngine,
    LLMError,
    LLMPrompt,
    LLMRequest,
    PromptMode,
    SamplingParams,
    TokenStream,
)
from engines.text import TextError
from engines.token2wav.base import SpeakerState, Token2WavStream
from engines.voice import VoicePrompt
from engines.voice_encoder import VoiceError
from realtime.access import OPERATOR
from realtime.admission import AdmissionPolicy, Load, Refuse
from realtime.config import ServiceConfig
from realtime.engine_loader import LLMsChosen, LoadedEngines, load_engines
from realtime.llm_build import LLMBuild
from realtime.memory_budget import MemoryBudgets, device_budgets, log_budgets, track_gpu_memory
from realtime.metrics import Metrics
from realtime.placement import WorkerLoad, least_loaded, split_capacity
from realtime.prompts import PromptCache, choose_mode
from realtime.render import render_segment
from realtime.schedule import EqualHops, ExponentialHops, Playback, ScheduleKind
from realtime.session import PreparedVoice, Segment, ServiceError, Session, SpeechRequest, language_code
from realtime.tasks import together
from realtime.token2wav_worker import Token2WavWorker
from realtime.voices import VoiceInfo, VoiceQuota, VoiceRegistry
from realtime.warm_up import WarmupPlan, compile_beside_llm, prepare_warmups, warm_up, warmup_batches

logger = logging.getLogger(__name__)

# Text tokens per LLM request when long text is cut into segments.
SEGMENT_TOKENS = 80


@dataclass(frozen=True)
class RuntimeStats:
    """What tests and `/metrics` read: admitted streams and what the engines hold."""

    active_streams: int
    llm_active: int
    llm_waiting: int
    token2wav_streams: int
    token2wav_queue: int


def _llm_steps(llms: Sequence[LLMEngine]) -> tuple[int, float]:
    """The LLM engines' decode steps and the seconds they took, summed (what a worker's hold reads)."""
    stats = [llm.stats() for llm in llms]
    return sum(s.steps for s in stats), sum(s.step_seconds for s in stats)


class Runtime:
    """Owns the engines; `open_session` / `speak` turn a `SpeechRequest` into a `Session` of audio chunks.

    Constructing it is cheap; `start()` loads the engines (through `loader`) and the voices.
    """

    def __init__(
        self,
        config: ServiceConfig,
        loader: Callable[[ServiceConfig, LLMsChosen | None], LoadedEngines] = load_engines,
    ) -> None:
        self.config = config
        self._first_chunk_rule = config.first_chunk_rule
        limits = config.limits
        self.voices = VoiceRegistry(
            config.voice_store,
            ModelPaths(config.models_dir).voices / "default.safetensors",
            VoiceQuota(
                limits.voices_per_client,
                limits.voice_bytes_per_client,
                limits.voices_total,
                limits.voice_bytes_total,
            ),
        )
        # One reference clip encoded at a time: uploads queue here instead of taking every core from
        # the streams being spoken.
        self._voice_encoding = asyncio.Semaphore(1)
        # Names of sessions and renders in the logs: drawn without a system call (os.urandom releases
        # the GIL on the event loop, where a burst's admissions run one after another).
        self._ids = random.Random()
        self.metrics = Metrics()
        self._loader = loader
        self._engines: LoadedEngines | None = None
        self._llm_build: LLMBuild | None = None  # the LLM engines' start, from `start` on
        self._workers: list[Token2WavWorker] = []
        self._placed: list[int] = []  # per token2wav worker: sessions placed on it and not yet closed
        self._capacity: list[int] = []  # per token2wav worker: the most sessions it takes
        self._memory_budgets = MemoryBudgets(0)  # per token2wav worker: its byte budget and reservations
        self._max_tokens = 0  # the most speech tokens one LLM request (one token2wav stream) may carry
        self._admission = AdmissionPolicy.for_streams(config.max_streams, config.retry_after_s)
        # Per voice, one PreparedVoice per token2wav worker (its speaker state lives on that device).
        self._prepared: dict[str, list[PreparedVoice]] = {}
        self._prompts: PromptCache | None = None  # LLM prompts per (voice, mode, instructions), once started
        self._sessions: set[Session] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = False
        self._voice_loads: dict[str, asyncio.Task[None]] = {}  # voices being read from the directory
        self._voice_sync: asyncio.Task[None] | None = None
        self._draining = False
        # Read when scraped rather than kept in step by hand.
        self.metrics.active_streams.set_function(lambda: len(self._sessions))
        self.metrics.token2wav_open_streams.set_function(
            lambda: sum(worker.open_streams for worker in self._workers)
        )
        self.metrics.queue_depth.set_function(lambda: sum(worker.queue_depth for worker in self._workers))
        self.metrics.track_placement(self._worker_loads)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load and start the engines, load the voices and prepare each one for synthesis. Once only."""
        if self._engines is not None:
            raise RuntimeError("a Runtime starts once")
        self._llm_build = build = LLMBuild(asyncio.get_running_loop())
        try:  # an LLM with a fixed cache starts building while token2wav loads (LLMBuild.chosen)
            engines = await asyncio.to_thread(self._loader, self.config, build.chosen)
        except BaseException:
            await build.end()
            raise
        config = self.config
        capacities = split_capacity(config.max_streams, len(engines.token2wavs))
        workers = [
            Token2WavWorker(backend, config.token2wav_batch, capacity=2 * capacity,
                            threads=config.token2wav_workers, metrics=self.metrics,
                            hold=config.first_chunk_hold, max_call_tokens=config.token2wav_call_tokens,
                            urgent_calls=config.urgent_chunk_calls,
                            llm_steps=lambda: _llm_steps(engines.llms),
                            name="token2wav" if len(engines.token2wavs) == 1 else f"token2wav{index}")
            for index, (backend, capacity) in enumerate(zip(engines.token2wavs, capacities, strict=True))
        ]
        for worker in workers:
            worker.start()
        self._engines, self._workers = engines, workers
        self._placed, self._capacity = [0] * len(workers), capacities
        try:
            await self._start_engines(engines)
        except BaseException:  # what this start began ends with it: threads, engines, compile processes
            try:
                await self.stop(drain_timeout_s=0.0)
            except Exception:  # the start's own error is the one to raise
                logger.exception("stopping what a failed start began failed too")
            raise

    async def _start_engines(self, engines: LoadedEngines) -> None:
        """`start`'s part after the token2wav workers run: build the LLM engines, prepare the voices and
        warm up (on shared GPUs one after the other), then accept streams."""
        assert self._llm_build is not None
        llm_build = self._llm_build
        self._prompts = PromptCache(engines.text)
        self._memory_budgets = MemoryBudgets(len(self._workers))
        self._max_tokens = max(llm.max_context for llm in engines.llms)
        track_gpu_memory(self.metrics, (*engines.plan.llm_devices, *engines.plan.token2wav_devices))
        self.metrics.track_llm(lambda: [llm.stats() for llm in engines.llms])
        started = time.perf_counter()
        if engines.plan.shared_gpus:
            # On a shared GPU the two build one after the other: at once they needed both warm-ups'
            # peaks plus two allocator caches (one per stream) and ran an 80 GB H100 out of memory
            # (docs/benchmarks.md, 2026-11-24 start-up). Where the policy allows (warm_up.py), the
            # voices come first (a few small calls) and what the token2wav warm-up has other processes
            # do (a cold start's compiling) runs while the LLM builds.
            # Free now, less the LLM's so far where it builds already (without waiting for its capture).
            free = {device: free_bytes(torch.device(device)) for device in engines.plan.shared_gpus}
            early = compile_beside_llm(engines.llms, engines.plan.token2wav_devices, free)
            if early:
                warmed_up = await self._prepare_voices()
                if warmed_up:
                    await prepare_warmups(self._warmup_plans(), early)
            await llm_build.wait(engines.llms)
            for device in engines.plan.shared_gpus:
                with torch.cuda.device(device):
                    empty_cache()  # the LLM warm-up's cached blocks, for token2wav's stream
            if not early:
                warmed_up = await self._prepare_voices()
            if warmed_up:
                await warm_up(self._warmup_plans(), self.config.warmup_between_calls)
        else:
            # Separate devices (or none): the LLM engines build (weights, compiled kernels, CUDA graphs)
            # while the token2wav workers prepare the voices and warm up; one side's file reads and
            # device work overlap the other's Python, and engines/cuda_graphs.py keeps the two sides'
            # captures apart.
            async def voices_then_warm_up() -> bool:
                due = await self._prepare_voices()
                if due:
                    await warm_up(self._warmup_plans(), self.config.warmup_between_calls)
                return due

            _, warmed_up = await together(llm_build.wait(engines.llms), voices_then_warm_up())
        if warmed_up:
            # From now on the process compiles nothing: a shape the warm-up did not meet (a voice with a
            # longer prompt, say) runs uncompiled rather than stalling every stream of an engine thread.
            torch.compiler.set_stance("eager_on_recompile")
            logger.info("engines started and warmed up in %.1f s; compilation closed",
                        time.perf_counter() - started)
        else:  # what a cold start prepared for a warm-up (compile processes) goes
            await asyncio.gather(*(worker.release_warmup() for worker in self._workers))
        await self._limit_memory()
        self._voice_sync = asyncio.create_task(self._sync_voices(), name="voice-sync")
        self._accepting = True
        plan = engines.plan
        logger.info("runtime ready: llm %s on %s, token2wav %s on %s, %d voices", engines.llms[0].name,
                    ",".join(plan.llm_devices), engines.token2wavs[0].name, ",".join(plan.token2wav_devices),
                    len(self._prepared))

    async def _limit_memory(self) -> None:
        """Set each token2wav worker's byte budget (`memory_budget.device_budgets`: measured now, after
        the warm-up, unless configured) and log it with the default voice's bound per stream. Measured off
        the event loop: emptying the allocator's cache waits for a warm-up step's capture under way."""
        config = self.config
        devices = [worker.device for worker in self._workers]
        self._memory_budgets.limit(await asyncio.to_thread(
            device_budgets, devices, config.token2wav_memory_bytes, config.token2wav_memory_margin_bytes))
        default = self._prepared.get("default")
        bounds: list[int | None] = ([voice.stream_bytes for voice in default]
                                    if default is not None else [None] * len(devices))
        measured = config.token2wav_memory_bytes is None
        log_budgets(self._memory_budgets.budgets, devices, bounds, self._capacity, self._max_tokens,
                    config.token2wav_memory_margin_gib if measured else None)

    async def _prepare_voices(self) -> bool:
        """Load the voices and prepare each on every token2wav worker. Returns whether a warm-up with the
        default voice is due (CUDA workers)."""
        await asyncio.to_thread(self.voices.load)
        for info in self.voices.list():
            await self._prepare(info.voice_id, self.voices.get(info.voice_id))
        return "default" in self._prepared and any(worker.device.type == "cuda" for worker in self._workers)

    def _warmup_plans(self) -> list[WarmupPlan]:
        """Per token2wav worker, the default voice's speaker and the batch sizes its warm-up runs."""
        voice, batch = self._prepared["default"], self.config.token2wav_batch
        return [(worker, prepared.speaker, warmup_batches(batch, capacity))
                for worker, prepared, capacity in zip(self._workers, voice, self._capacity, strict=True)]

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
        for task in (self._voice_sync, *self._voice_loads.values()):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._llm_build is not None:  # the engines it started stop; one still building is waited for
            await self._llm_build.end()
        for worker in self._workers:
            await asyncio.to_thread(worker.stop)

    def begin_drain(self) -> None:
        """Shutting down: new work is refused (`shutting_down`), work already accepted carries on."""
        self._draining = True

    async def wait_idle(self) -> None:
        """Return once no session is running."""
        await self._idle.wait()

    @property
    def ready(self) -> bool:
        return self._accepting and not self._draining

    @property
    def warming_up(self) -> bool:
        """Ready, while a token2wav warm-up still runs between calls (`--warm-up-between-calls`)."""
        return any(worker.warming_up for worker in self._workers)

    @property
    def draining(self) -> bool:
        return self._draining

    def stats(self) -> RuntimeStats:
        engines = self._running()
        llms = [llm.stats() for llm in engines.llms]
        return RuntimeStats(
            len(self._sessions),
            sum(llm.active for llm in llms),
            sum(llm.waiting for llm in llms),
            sum(worker.open_streams for worker in self._workers),
            sum(worker.queue_depth for worker in self._workers),
        )

    def _running(self) -> LoadedEngines:
        if self._engines is None:
            raise ServiceError("not_ready", "the server is still starting", 503, self.config.retry_after_s)
        return self._engines

    def _worker_loads(self) -> list[tuple[str, WorkerLoad]]:
        """Each token2wav worker's device and load (`/metrics` shows them)."""
        return [(str(worker.device), load) for worker, load in zip(self._workers, self._loads(), strict=True)]

    def _loads(self) -> list[WorkerLoad]:
        """Each token2wav worker's load (what placement decides on)."""
        return [
            WorkerLoad(placed, capacity, worker.alive, reserved, budget)
            for worker, placed, capacity, reserved, budget in zip(
                self._workers, self._placed, self._capacity, self._memory_budgets.reserved,
                self._memory_budgets.budgets, strict=True)
        ]

    def _place(self, voice: Sequence[PreparedVoice]) -> tuple[int, _Engines, int]:
        """The token2wav worker a new stream of `voice` goes to (the one with the most room), the LLM
        engine that serves it (the one on the same device, else the least busy) and the bytes it
        reserves there, reserved now (`MemoryBudgets.release` gives them back); ServiceError `busy` when every
        worker is full in streams or bytes, or dead."""
        engines = self._running()
        loads = self._loads()
        needs = [prepared.stream_bytes for prepared in voice]
        index = least_loaded(loads, needs)
        if index is None:
            if not any(worker.alive for worker in self._workers):
                raise ServiceError("engine_failed", "no token2wav worker is running", 503,
                                   self.config.retry_after_s)
            if any(load.alive and load.streams < load.capacity for load in loads):
                raise ServiceError("busy", "no token2wav worker has device memory left for another stream",
                                   429, self.config.retry_after_s)
            raise ServiceError("busy", "every token2wav worker is at its limit of streams", 429,
                               self.config.retry_after_s)
        same_device = engines.plan.llm_for(index)
        llm = engines.llms[same_device] if same_device is not None else min(engines.llms, key=_requests_held)
        self._memory_budgets.reserve(index, needs[index])
        return index, _Engines(llm, self._workers[index]), needs[index]

    # -- synthesis -----------------------------------------------------------------------------

    async def open_session(self, request: SpeechRequest, continuing: bool = False,
                           playback: Playback | None = None) -> Session:
        """`speak`, once the request's voice is usable here: a voice another replica just stored in the
        shared directory is loaded first (`ensure_voice`). What transports call. Returns once the text is
        cut into segments (raising its ServiceError, such as `empty_text`), except for `continuing`
        work, whose errors come from the iteration like any other. `playback`: the listener's timeline when
        this request follows others to it (see `Playback`)."""
        await self.ensure_voice(request.voice)
        session = self.speak(request, continuing, playback)
        if not continuing:
            try:
                await session.prepare()
            except BaseException:
                # Cancelled while the text was cut (a client gone): no caller will ever hold the session,
                # so it closes here, giving back its admission and reserved bytes (a refusal closed it).
                await session.aclose()
                raise
        return session

    def speak(self, request: SpeechRequest, continuing: bool = False,
              playback: Playback | None = None) -> Session:
        """A session for `request`, admitted now; raises ServiceError when it cannot be served.

        `continuing`: the request carries on work accepted before a drain began (the next sentence of
        an open websocket context), which a drain lets finish; other new work is refused meanwhile.
        """
        with self._counting_errors():
            return self._admit(request, continuing, playback)

    @contextlib.contextmanager
    def _counting_errors(self) -> Iterator[None]:
        try:
            yield
        except ServiceError as exc:
            self.metrics.error(exc.code)
            raise

    def _admit(self, request: SpeechRequest, continuing: bool, playback: Playback | None) -> Session:
        if not self._accepting or (self._draining and not continuing):
            raise ServiceError("shutting_down", "the server is shutting down", 503, self.config.retry_after_s)
        voices = self._voice(request.voice)
        mode = choose_mode(request, voices[0].language)
        prompt = self._prompt_of(voices[0], mode, request.instructions)
        self._check_text(request.text)
        decision = self._admission.decide(Load(
            len(self._sessions),
            sum(llm.waiting for llm in self._running().llms),
            sum(worker.queue_depth for worker in self._workers),
        ))
        if isinstance(decision, Refuse):
            raise ServiceError("busy", decision.reason, 429, decision.retry_after_s)
        index, placed, reserved = self._place(voices)
        session_id = self.new_id()
        session: Session

        def release() -> None:
            if session in self._sessions:
                self._placed[index] -= 1
                self._memory_budgets.release(index, reserved)
            self._sessions.discard(session)
            self._track_sessions()

        first_hop = self._first_chunk_rule.first_hop(self._placed[index])
        try:
            placed.check_mode(mode)
            session = Session(
                session_id,
                request,
                voices[index],
                prompt,
                functools.partial(self._segments, request.text),
                placed,
                self.metrics,
                self.config.chunk_queue,
                on_close=release,
                pace_llm=self.config.llm_pacing,
                schedule=self.config.schedule,
                first_chunk_tokens=first_hop,
                retry_after_s=self.config.retry_after_s,
                prepare_on_loop=self._running().text.prepares_quickly(request.text, SEGMENT_TOKENS),
                playback=playback,
            )
        except BaseException:  # not handed to a session: nothing else would give the bytes back
            self._memory_budgets.release(index, reserved)
            raise
        self._sessions.add(session)
        self._placed[index] += 1
        self._track_sessions()
        if self.config.schedule is ScheduleKind.EXPONENTIAL:
            self.metrics.first_chunk_hops.labels(str(first_hop)).inc()
        # DEBUG: a burst admits streams back to back on the loop; the session's closing line (INFO)
        # names its voice and length.
        logger.debug(
            "[%s] admitted: voice %s, %s, %d chars, token2wav on %s",
            session_id,
            request.voice,
            mode,
            len(request.text),
            placed.worker.device,
        )
        return session

    def new_id(self) -> str:
        """A short id for log lines (sessions, renders, connections): not a secret, so no system call."""
        return f"{self._ids.getrandbits(32):08x}"

    def _voice(self, voice_id: str) -> list[PreparedVoice]:
        """The voice prepared on every token2wav worker (one entry per worker, in order). A voice that
        another replica deleted from the shared directory is forgotten here (one stat)."""
        voice = self._prepared.get(voice_id)
        if voice is not None and not self.voices.on_disk(voice_id):
            self._forget_voice(voice_id)
            voice = None
        if voice is None:
            raise ServiceError("voice_not_found", f"there is no voice {voice_id!r}", 404)
        return voice

    def _prompt_of(self, voice: PreparedVoice, mode: PromptMode, instructions: str | None) -> LLMPrompt:
        if self._prompts is None:
            raise ServiceError("not_ready", "the server is still starting", 503, self.config.retry_after_s)
        return self._prompts.get(voice, mode, instructions)

    def _check_text(self, text: str) -> None:
        """The checks that cost nothing, made before admission; normalising and cutting the text (which
        can take hundreds of milliseconds) happen after it, off the event loop unless the text is quick
        (`_segments`, `TextFrontend.prepares_quickly`)."""
        limit = self._running().text.max_text_chars
        if len(text) > limit:
            raise ServiceError("text_too_long", f"text has {len(text)} characters; the limit is {limit}", 400)
        if not text.strip():
            raise ServiceError("empty_text", "text is empty or only whitespace", 400)

    def _segments(self, text: str) -> list[Segment]:
        """`text` cut into LLM requests, or ServiceError (`text_too_long`, `empty_text`, ...). Blocking:
        sessions call it on a worker thread, or on the loop for quick text (`prepares_quickly`)."""
        engines = self._running()
        try:
            pieces = engines.text.encode_segments(text, SEGMENT_TOKENS)
            return [Segment(piece, tuple(ids)) for piece, ids in pieces]
        except TextError as exc:
            raise ServiceError(exc.code, str(exc), 400) from exc

    # -- offline synthesis ---------------------------------------------------------------------

    async def render(self, text: str, voice: str, sampling: SamplingParams, instructions: str | None = None,
                     language: str | None = None) -> np.ndarray:
        """The whole utterance at once (offline, no admission): 24 kHz float32 audio, in the mode
        `instructions` and `language` choose (`realtime.prompts.choose_mode`).

        Every segment's LLM request is submitted at once; each segment's tokens then go to token2wav in
        chunks as they are decoded (`render_hop`, or else the exponential schedule's; the last chunk
        whatever is left), which the worker batches with the chunks of other renders. Cancelling frees
        the LLM requests and token2wav streams. Raises ServiceError.
        """
        with self._counting_errors():
            speech = SpeechRequest(text, voice, sampling, instructions=instructions, language=language)
            voices = self._voice(voice)
            mode = choose_mode(speech, voices[0].language)
            prompt = self._prompt_of(voices[0], mode, speech.instructions)
            worker, placed, reserved = self._place(voices)
            prepared = voices[worker]
            render_id = self.new_id()
            token_streams: list[TokenStream] = []
            try:
                placed.check_mode(mode)
                segments = await asyncio.to_thread(self._segments, text)
                for index, segment in enumerate(segments):
                    request = prompt.request(f"{render_id}-{index}", segment.text_ids, sampling)
                    token_streams.append(placed.submit_llm(request))
                render_hop = self.config.render_hop
                hops = (ExponentialHops(first=self.config.first_chunk_tokens) if render_hop is None
                        else EqualHops(render_hop))
                pieces = [await render_segment(placed.worker, prepared.speaker, tokens, hops)
                          for tokens in token_streams]
            except LLMError as exc:
                raise ServiceError(exc.code, str(exc), 500) from exc
            finally:
                self._memory_budgets.release(worker, reserved)
                for token_stream in token_streams:
                    token_stream.cancel()
        return np.concatenate(pieces)

    def _track_sessions(self) -> None:
        if self._sessions:
            self._idle.clear()
        else:
            self._idle.set()

    # -- voices --------------------------------------------------------------------------------

    async def add_voice(self, voice_id: str, audio: bytes, transcript: str,
                        language: str | None = None, *, owner: str = OPERATOR) -> VoiceInfo:
        """Extract a voice from a reference clip and its transcript, store it as `owner`'s (a principal,
        `access.py`) and make it usable. Its language is `language` if given, else detected from the
        transcript. The id is reserved first, so a concurrent upload or delete of it is refused at once."""
        with self._counting_errors():
            self.voices.reserve(voice_id, owner)
            try:
                return await self._add_voice(voice_id, audio, transcript, language)
            finally:
                self.voices.release(voice_id)  # a no-op once committed

    async def _add_voice(self, voice_id: str, audio: bytes, transcript: str,
                         language: str | None) -> VoiceInfo:
        engines = self._running()
        code = language_code(language) if language is not None else ""
        async with self._voice_encoding:
            try:
                prompt = await asyncio.to_thread(engines.voice_encoder.encode, audio, transcript)
            except VoiceError as exc:
                raise ServiceError(exc.code, str(exc), 400) from exc
        if code:
            prompt = dataclasses.replace(prompt, language=code)
        self.voices.check_room(voice_id, _stored_bytes(prompt))
        await self._prepare(voice_id, prompt)
        try:
            size = await asyncio.to_thread(self.voices.store, voice_id, prompt)
            return self.voices.commit(voice_id, prompt, size)
        except BaseException:
            self._prepared.pop(voice_id, None)
            raise

    async def remove_voice(self, voice_id: str, requester: str | None = None) -> None:
        """Delete a voice; with `requester`, only the principal that uploaded it may."""
        await self.ensure_voice(voice_id)  # another replica may have stored it
        with self._counting_errors():
            self.voices.remove(voice_id, requester)
        self._forget_voice(voice_id)

    async def ensure_voice(self, voice_id: str) -> None:
        """Make usable here a voice that another replica stored in the shared voices directory, before
        its first use; transports call it before `speak`. One stat when there is nothing to do; loads
        of one voice by concurrent requests are shared."""
        if voice_id in self._prepared or not self.voices.on_disk(voice_id):
            return  # ready, or `speak` answers voice_not_found
        load = self._voice_loads.get(voice_id)
        if load is None:
            load = self._voice_loads[voice_id] = asyncio.create_task(self._load_voice(voice_id))
            load.add_done_callback(lambda _: self._voice_loads.pop(voice_id, None))
        await asyncio.shield(load)

    async def _load_voice(self, voice_id: str) -> None:
        stored = await asyncio.to_thread(self.voices.read, voice_id)
        if stored is not None and voice_id not in self._prepared and self.voices.adopt(voice_id, stored):
            await self._prepare(voice_id, stored.prompt)
            logger.info("voice %s loaded from the shared directory", voice_id)

    async def _sync_voices(self) -> None:
        """Every `voice_sync_s`, adopt the voices other replicas stored and forget those they deleted,
        so that listings agree across replicas and first uses rarely wait for a load."""
        while True:
            await asyncio.sleep(self.config.voice_sync_s)
            try:
                stored = await asyncio.to_thread(self.voices.stored_ids)
                for voice_id in sorted(self.voices.known_ids() - stored):
                    if not self.voices.on_disk(voice_id):  # not re-stored since the listing
                        self._forget_voice(voice_id)
                for voice_id in sorted(stored - self.voices.known_ids()):
                    await self.ensure_voice(voice_id)
            except Exception:  # a failing shared volume must not end the sync for good
                logger.exception("syncing the voices directory failed")

    def _forget_voice(self, voice_id: str) -> None:
        self.voices.forget(voice_id)
        self._prepared.pop(voice_id, None)
        if self._prompts is not None:
            self._prompts.forget(voice_id)

    async def _prepare(self, voice_id: str, prompt: VoicePrompt) -> None:
        """Make the voice usable on every token2wav worker (its speaker state lives on that device)."""
        engines = self._running()
        speakers = await asyncio.gather(*(worker.prepare_speaker(prompt) for worker in self._workers))
        prompt_text_ids = tuple(engines.text.encode_transcript(prompt.prompt_text))
        prompt_speech_tokens = tuple(int(t) for t in prompt.speech_tokens.tolist())
        # What a stream of the voice reserves on each worker: its state's bound (0 where the backend gives
        # none, which admission then counts only by streams).
        bounds = [token2wav.stream_bytes_bound(speaker, self._max_tokens)
                  for token2wav, speaker in zip(engines.token2wavs, speakers, strict=True)]
        self._prepared[voice_id] = [
            PreparedVoice(voice_id, prompt_text_ids, prompt_speech_tokens, speaker, prompt.language,
                          bound or 0)
            for speaker, bound in zip(speakers, bounds, strict=True)
        ]
        if self._prompts is not None:
            self._prompts.forget(voice_id)


def _requests_held(llm: LLMEngine) -> int:
    """Requests an LLM engine is decoding or holding in its waiting line."""
    stats = llm.stats()
    return stats.active + stats.waiting


def _stored_bytes(prompt: VoicePrompt) -> int:
    """About the size of a voice's file: its tensors and transcript."""
    tensors = (prompt.speech_tokens, prompt.speaker_embedding, prompt.prompt_mel)
    return sum(t.numel() * t.element_size() for t in tensors) + len(prompt.prompt_text.encode())


@dataclass(frozen=True)
class _Engines:
    """The `session.Engines` a session sees: the LLM and the token2wav worker."""

    llm: LLMEngine
    worker: Token2WavWorker

    def submit_llm(self, request: LLMRequest) -> TokenStream:
        return self.llm.submit(request)

    def check_mode(self, mode: PromptMode) -> None:
        """ServiceError `mode_not_supported` unless the LLM engine serves `mode`."""
        if mode not in self.llm.modes:
            served = ", ".join(sorted(self.llm.modes))
            raise ServiceError("mode_not_supported", f"this server's {self.llm.name} LLM engine does not "
                                                     f"serve {mode} requests (it serves: {served})")

    async def open_stream(self, speaker: SpeakerState, first_audio: bool = True) -> Token2WavStream:
        return await self.worker.open_stream(speaker, first_audio)

    async def synthesize(
        self, stream: Token2WavStream, tokens: Sequence[int], last: bool, due: float
    ) -> np.ndarray:
        return await self.worker.synthesize(stream, tokens, last, due)

    def close_stream(self, stream: Token2WavStream) -> None:
        self.worker.close_stream(stream)


__all__ = ["Runtime", "RuntimeStats", "ServiceError"]
