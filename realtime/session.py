"""One utterance: text in, 24 kHz audio chunks out. No I/O: transports drain a `Session`.

Contract (transports code against this):

- `Runtime.open_session(SpeechRequest) -> Session` (what transports call) makes the cheap checks and
  admits at once (`Runtime.speak`; raises `ServiceError`: `busy`, `voice_not_found`, `text_too_long`,
  ...), then returns once the text is normalised and cut into segments on a worker thread
  (`Session.prepare`; seconds for long runs of numbers; a quick text on the loop), raising the front
  end's refusal (`empty_text`, ...) there. The `Session` is an async iterator of `AudioChunk`s: float32
  mono PCM at 24000 Hz whose concatenation is the utterance; the last one has `final=True`. Errors from
  then on (a length the engine cannot hold, an engine failure) are raised from the iteration as
  `ServiceError`, so an HTTP handler that wants a status code for them awaits the first chunk before
  answering. A `continuing` session (a websocket context's next sentence) is not prepared first: all
  its errors come from the iteration.
- Always end a session with `await session.aclose()` (or `async with session:`); that (or cancelling
  the task iterating it) stops synthesis within one chunk and frees the LLM slot and the token2wav
  stream at once. Synthesis starts at the first iteration (or at `session.start()`, to prepare audio
  ahead) and runs ahead of the consumer by at most `chunk_queue` chunks, so a slow consumer slows
  only its own stream.

Long text is synthesised as several segments (one LLM request and one token2wav stream each) whose
audio follows without a gap. Word timings are exact at segment boundaries and estimated within a
segment (spread over the segment in proportion to word length; marked `estimated=True`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

import numpy as np

from engines.config import SAMPLE_RATE, TOKEN_RATE_HZ
from engines.errors import CodedError
from engines.inline_tags import strip_tags
from engines.llm.base import LLMError, LLMPrompt, LLMRequest, PromptMode, SamplingParams, TokenStream
from engines.token2wav.base import SpeakerState, Token2WavStream
from realtime.audio import MAX_SPEED, MIN_SPEED, TempoStretcher
from realtime.metrics import Metrics
from realtime.schedule import (
    ChunkScheduler,
    ExponentialHops,
    Playback,
    Progress,
    ScheduleKind,
    make_policy,
)

logger = logging.getLogger(__name__)

# A rough speaking rate (about 15 characters per second), only used to spread word timings inside a
# segment before its real length is known.
SPEECH_SECONDS_PER_CHAR = 0.065


class ServiceError(CodedError):
    """A request the service cannot serve: `code` is machine readable, `message` a sentence for people."""

    def __init__(
        self, code: str, message: str, http_status: int = 400, retry_after_s: int | None = None
    ) -> None:
        super().__init__(code, message)
        self.http_status = http_status
        self.retry_after_s = retry_after_s


_LANGUAGE = re.compile(r"[a-z]{2,3}")


def language_code(tag: str) -> str:
    """The primary language subtag of a BCP 47 tag or ISO 639 code, lower case (`en-US` → `en`);
    ServiceError `invalid_language` for anything else."""
    primary = tag.strip().replace("_", "-").split("-")[0].lower()
    if not _LANGUAGE.fullmatch(primary):
        raise ServiceError("invalid_language", f"language must be an ISO 639 code such as 'en' or 'zh', "
                                               f"got {tag[:20]!r}")
    return primary


@dataclass(frozen=True)
class SpeechRequest:
    """What to say and how. `sampling` carries the seed and, for tests/benchmarks, a fixed length.

    `instructions` (a style in words: emotion, rate, dialect, role) asks for the instruct2 mode;
    `language` (ISO 639, stored as its primary subtag) for cross-lingual synthesis when it differs from
    the voice's; `mode` names a mode explicitly (`realtime.prompts.choose_mode` decides). Blank
    instructions count as none.
    """

    text: str
    voice: str = "default"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speed: float = 1.0
    instructions: str | None = None
    language: str | None = None
    mode: PromptMode | None = None

    def __post_init__(self) -> None:
        if not MIN_SPEED <= self.speed <= MAX_SPEED:
            raise ServiceError(
                "invalid_speed", f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {self.speed}"
            )
        if self.language is not None:
            object.__setattr__(self, "language", language_code(self.language))
        if self.instructions is not None and not self.instructions.strip():
            object.__setattr__(self, "instructions", None)


@dataclass(frozen=True)
class WordTiming:
    """A word and where it is spoken, in seconds from the start of the utterance."""

    word: str
    start_s: float
    end_s: float
    estimated: bool


@dataclass(frozen=True)
class AudioChunk:
    """`pcm`: float32 (samples,) mono at 24000 Hz. `words`: the words that start in this chunk."""

    pcm: np.ndarray
    seq: int
    start_s: float
    duration_s: float
    words: tuple[WordTiming, ...]
    final: bool


@dataclass(frozen=True)
class PreparedVoice:
    """A voice ready for synthesis on one token2wav worker: its zero-shot LLM prompt ids/tokens, its
    language, the token2wav speaker state (used in every mode) and a stream's memory bound there."""

    voice_id: str
    prompt_text_ids: tuple[int, ...]
    prompt_speech_tokens: tuple[int, ...]
    speaker: SpeakerState
    language: str
    stream_bytes: int = 0  # what a stream of it reserves on its worker (0: counted by streams only)


@dataclass(frozen=True)
class Segment:
    """One LLM request's worth of text."""

    text: str
    text_ids: tuple[int, ...]

    @property
    def words(self) -> list[str]:
        """The spoken words (inline tags are sounds, not words)."""
        return strip_tags(self.text).split()


@dataclass(frozen=True)
class Usage:
    """Tokens of one session: text tokens read by the LLM (prompt excluded) and speech tokens decoded."""

    text_tokens: int
    speech_tokens: int


class Engines(Protocol):
    """What a session needs from the runtime: the LLM and the token2wav worker."""

    def submit_llm(self, request: LLMRequest) -> TokenStream: ...

    async def open_stream(self, speaker: SpeakerState, first_audio: bool = True) -> Token2WavStream:
        """A token2wav stream; `first_audio`: its first chunk is its listener's first audio (the worker
        holds first-audio calls for such streams' first chunks)."""
        ...

    async def synthesize(
        self, stream: Token2WavStream, tokens: Sequence[int], last: bool, due: float
    ) -> np.ndarray:
        """24 kHz float32 audio of one chunk (computed on the token2wav worker thread); chunks run
        earliest `due` first (see `realtime.schedule.chunk_due`)."""
        ...

    def close_stream(self, stream: Token2WavStream) -> None:
        """Release the stream's caches as soon as the worker is free; returns at once."""
        ...


class WordTimer:
    """Word timings inside one segment, in speech seconds from the segment start.

    The first start and the last end are exact (the segment's audio boundaries); inner boundaries are
    spread in proportion to word length over the segment's estimated length, which grows to what has
    been decoded so far until the real length is known.
    """

    def __init__(self, words: Sequence[str], expected_s: float) -> None:
        self._words = list(words)
        weights = [len(w) + 1 for w in self._words]
        total = float(sum(weights)) or 1.0
        self._fractions = [sum(weights[:i]) / total for i in range(len(weights) + 1)]
        self._expected_s = expected_s
        self._next = 0
        self._last_end = 0.0

    def due(self, audio_end_s: float, known_s: float) -> list[tuple[str, float, float, bool]]:
        """Words (but not the last) whose estimated start is before `audio_end_s`."""
        length = max(self._expected_s, known_s)
        out = []
        while self._next < len(self._words) - 1:
            start = max(self._last_end, self._fractions[self._next] * length)
            if start >= audio_end_s:
                break
            out.append(self._emit(start, self._fractions[self._next + 1] * length))
        return out

    def finish(self, length_s: float) -> list[tuple[str, float, float, bool]]:
        """Every word not yet returned, placed with the segment's real length."""
        out = []
        while self._next < len(self._words):
            is_last = self._next == len(self._words) - 1
            start = min(max(self._last_end, self._fractions[self._next] * length_s), length_s)
            out.append(self._emit(start, length_s if is_last else self._fractions[self._next + 1] * length_s))
        return out

    def _emit(self, start: float, end: float) -> tuple[str, float, float, bool]:
        index = self._next
        end = max(start, end)
        exact = len(self._words) == 1  # both of its ends are segment boundaries
        self._next += 1
        self._last_end = end
        return self._words[index], start, end, not exact


_END = object()


class Session:
    """Synthesises one `SpeechRequest`; iterate it for `AudioChunk`s, then `aclose()` it.

    Created by `Runtime.speak` after admission; `on_close` gives the admission back exactly once.
    """

    def __init__(
        self,
        session_id: str,
        request: SpeechRequest,
        voice: PreparedVoice,
        prompt: LLMPrompt,
        segments: Callable[[], Sequence[Segment]],
        engines: Engines,
        metrics: Metrics,
        chunk_queue: int,
        on_close: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        pace_llm: bool = True,
        schedule: ScheduleKind = ScheduleKind.EXPONENTIAL,
        first_chunk_tokens: int = ExponentialHops.first,
        retry_after_s: int = 1,
        prepare_on_loop: bool = False,
        playback: Playback | None = None,
    ) -> None:
        self.session_id = session_id
        self.request = request
        self._voice = voice
        self._prompt = prompt
        self._prepare_segments = segments
        # Quick text (a fraction of a millisecond) is cut here: a worker thread's round trip through the
        # GIL and the event loop costs more, and a burst of sessions queues behind those hops.
        self._prepare_on_loop = prepare_on_loop
        self._segments: list[Segment] = []  # once prepared
        self._engines = engines
        self._metrics = metrics
        self._clock = clock
        self._pace_llm = pace_llm
        self._retry_after_s = retry_after_s  # what a `busy` from the LLM engine suggests
        self._policy = make_policy(schedule, first_chunk_tokens)  # stateless: one for every segment
        self._on_close: Callable[[], None] | None = on_close
        self._out: asyncio.Queue[object] = asyncio.Queue(maxsize=chunk_queue)
        self._task: asyncio.Task[None] | None = None
        self._prepared = asyncio.Event()  # the text is cut into segments (or refused)
        self._refusal: ServiceError | None = None  # why the text was refused, if it was
        self._done = False
        self._created = clock()
        # Output bookkeeping (producer side).
        self._seq = 0
        self._upcoming: TokenStream | None = None  # the next segment's LLM request, once started
        self._speech_tokens = 0
        self._samples_out = 0
        self._speech_s = 0.0
        # The listener's timeline, which chunks are due by: shared with the sessions before and after
        # this one on the same listener (a websocket context), else this session's own.
        self._playback = playback or Playback()
        self._stretcher = TempoStretcher(request.speed) if request.speed != 1.0 else None

    # -- consumer side ---------------------------------------------------------------------------

    def since_admission(self) -> float:
        """Seconds since the request was admitted, on the clock the session's latency metrics use."""
        return self._clock() - self._created

    @property
    def usage(self) -> Usage:
        """Tokens so far (final once the iteration has ended)."""
        return Usage(sum(len(s.text_ids) for s in self._segments), self._speech_tokens)

    async def prepare(self) -> None:
        """Start, and return once the text is normalised and cut into segments; raises the text's
        ServiceError (`empty_text`, ...) instead, having closed the session. For transports that answer
        with a status code: the front end's refusal is still a 4xx, not a 200 with no audio."""
        self.start()
        await self._prepared.wait()
        if self._refusal is not None:
            await self.aclose()
            raise self._refusal

    def start(self) -> None:
        """Begin synthesis now rather than at the first iteration (to have audio ready sooner)."""
        if self._task is None and not self._done:
            self._task = asyncio.create_task(self._produce(), name=f"tts-session-{self.session_id}")

    def __aiter__(self) -> Session:
        return self

    async def __anext__(self) -> AudioChunk:
        if self._done:
            raise StopAsyncIteration
        self.start()
        item = await self._out.get()
        if item is _END:
            await self.aclose()
            raise StopAsyncIteration
        if isinstance(item, ServiceError):
            await self.aclose()
            raise item
        assert isinstance(item, AudioChunk)
        return item

    async def aclose(self) -> None:
        """Stop synthesis (if still running) and free everything it holds. Idempotent."""
        self._done = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._release_admission()
        # Wake a consumer that another task may have left waiting on the queue.
        while not self._out.empty():
            self._out.get_nowait()
        self._out.put_nowait(_END)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _release_admission(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    # -- producer side ---------------------------------------------------------------------------

    async def _produce(self) -> None:
        started = self._clock()
        try:
            # Normalising and cutting the text may take a while: off the event loop, after admission,
            # unless it is quick (`TextFrontend.prepares_quickly`).
            if self._prepare_on_loop:
                self._segments = list(self._prepare_segments())
            else:
                self._segments = list(await asyncio.to_thread(self._prepare_segments))
            if not self._segments:
                raise ServiceError("empty_text", "text is empty or only whitespace")
            self._metrics.text_prepared.observe(self._clock() - self._created)
            self._prepared.set()
            for index, segment in enumerate(self._segments):
                token_stream, self._upcoming = self._upcoming or self._submit(index), None
                await self._speak_segment(segment, token_stream, index + 1)
            wall = self._clock() - started
            if self._speech_s > 0:
                self._metrics.real_time_factor.observe(wall / self._speech_s)
            logger.info(
                "[%s] done: voice %s, %d chars, %d chunks, %.2f s of audio in %.2f s",
                self.session_id,
                self.request.voice,
                len(self.request.text),
                self._seq,
                self._samples_out / SAMPLE_RATE,
                wall,
            )
            await self._out.put(_END)
        except asyncio.CancelledError:
            logger.info("[%s] cancelled after %d chunks: voice %s, %d chars", self.session_id, self._seq,
                        self.request.voice, len(self.request.text))
            raise
        except ServiceError as exc:
            logger.warning("[%s] failed: %s (voice %s, %d chars)", self.session_id, exc.code,
                           self.request.voice, len(self.request.text))
            self._metrics.error(exc.code)
            await self._fail(exc)
        except Exception as exc:
            logger.exception("[%s] synthesis failed", self.session_id)
            self._metrics.error("internal_error")
            await self._fail(ServiceError("internal_error", f"synthesis failed: {type(exc).__name__}", 500))
        finally:
            self._prepared.set()
            if self._upcoming is not None:
                self._upcoming.cancel()
                self._upcoming = None

    async def _fail(self, error: ServiceError) -> None:
        """Hand `error` to the consumer: to `prepare` if the text never got cut, else to the iteration
        (after the chunks before it)."""
        if not self._prepared.is_set():
            self._refusal = error
            self._prepared.set()
        await self._out.put(error)

    def _submit(self, index: int) -> TokenStream:
        """Start the LLM request of segment `index`."""
        try:
            token_stream = self._engines.submit_llm(self._prompt.request(
                f"{self.session_id}-{index}", self._segments[index].text_ids, self.request.sampling))
        except LLMError as exc:
            if exc.code == "busy":  # the engine's waiting line is full: the same answer as admission's
                raise ServiceError("busy", str(exc), 429, self._retry_after_s) from exc
            raise ServiceError(exc.code, str(exc), 400) from exc
        if self._pace_llm:
            token_stream.want(ChunkScheduler(self._policy).tokens_wanted())
        return token_stream

    async def _speak_segment(self, segment: Segment, token_stream: TokenStream, next_index: int) -> None:
        """Synthesise one segment from its token stream. When its tokens are complete, the next
        segment's LLM request starts (`self._upcoming`), so its first chunk is ready sooner."""
        last_segment = next_index == len(self._segments)
        low, high = self.request.sampling.length_bounds(len(segment.text_ids))
        expected_tokens = min(high, max(low, len(segment.text) * SPEECH_SECONDS_PER_CHAR * TOKEN_RATE_HZ))
        timer = WordTimer(segment.words, expected_tokens / TOKEN_RATE_HZ)
        segment_start_s = self._speech_s
        scheduler = ChunkScheduler(self._policy)
        stream: Token2WavStream | None = None
        tokens: list[int] = []
        try:
            first_audio = not self._playback.started
            stream = await self._engines.open_stream(self._voice.speaker, first_audio=first_audio)
            decode_started = self._clock()
            ended = False
            while not scheduler.finished:
                progress = self._progress(len(tokens), decode_started)
                chunk = scheduler.next_chunk(len(tokens), ended, progress)
                if chunk is None:
                    if self._pace_llm:  # the tokens of the next chunk, not seconds ahead of playback
                        token_stream.want(scheduler.tokens_wanted(progress))
                    try:
                        tokens.extend(await anext(token_stream))
                    except StopAsyncIteration:
                        ended = True
                        if not last_segment:
                            self._upcoming = self._submit(next_index)
                    except LLMError as exc:
                        raise ServiceError(exc.code, str(exc), 500) from exc
                    continue
                if not self._playback.started and chunk.index == 0:  # the listener's first audio
                    self._metrics.first_chunk_tokens.observe(self.since_admission())
                pcm = np.zeros(0, dtype=np.float32)
                if chunk.end > chunk.start:
                    pcm = await self._engines.synthesize(
                        stream,
                        tokens[chunk.start : chunk.end],
                        chunk.last,
                        due=self._playback.due(),
                    )
                chunk_end_s = segment_start_s + scheduler.offset / TOKEN_RATE_HZ
                if chunk.last:
                    words = timer.finish(len(tokens) / TOKEN_RATE_HZ)
                else:
                    words = timer.due(chunk_end_s - segment_start_s, len(tokens) / TOKEN_RATE_HZ)
                self._speech_s = chunk_end_s
                await self._emit(
                    pcm,
                    [(w, segment_start_s + s, segment_start_s + e, est) for w, s, e, est in words],
                    final=chunk.last and last_segment,
                )
        finally:
            self._speech_tokens += len(tokens)
            token_stream.cancel()
            if stream is not None:
                self._engines.close_stream(stream)

    def _progress(self, tokens: int, decode_started: float) -> Progress:
        now = self._clock()
        elapsed = now - decode_started
        return Progress(audio_ahead_s=self._playback.ahead_s(now),
                        tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0)

    async def _emit(self, pcm: np.ndarray, words: list[tuple[str, float, float, bool]], final: bool) -> None:
        speed = self.request.speed
        if self._stretcher is not None:
            pcm = self._stretcher.process(pcm)
            if final:
                pcm = np.concatenate([pcm, self._stretcher.flush()])
        if pcm.size == 0 and not words and not final:
            return
        start_s = self._samples_out / SAMPLE_RATE
        chunk = AudioChunk(
            pcm=pcm.astype(np.float32, copy=False),
            seq=self._seq,
            start_s=start_s,
            duration_s=pcm.size / SAMPLE_RATE,
            words=tuple(WordTiming(w, s / speed, e / speed, est) for w, s, e, est in words),
            final=final,
        )
        now = self._clock()
        if not self._playback.started and pcm.size:  # the listener's first audio
            self._metrics.first_chunk_latency.observe(now - self._created)
        self._playback.produced(now, chunk.duration_s)
        self._seq += 1
        self._samples_out += pcm.size
        self._metrics.audio_seconds.inc(chunk.duration_s)
        await self._out.put(chunk)
