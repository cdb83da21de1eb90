"""The agents' websocket protocol: a sans-I/O state machine, and the message parsing its dialects share.

The core (`AgentProtocol`) knows nothing of sockets or engines. Dialects (`native.py`, the `/v1/ws`
wire format; `cartesia.py`; `elevenlabs.py`) turn frames into `Command`s and events into frames;
the core turns commands into `Action`s the transport executes (speak this text in that context, abort
a context, release an ended one, send an event, close); the transport reports back when a `Speak` has
been fully sent.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.errors import CodedError
from engines.llm.base import PromptMode
from engines.text import StreamingSentenceSplitter
from realtime import validation
from realtime.audio import MAX_SPEED, MIN_SPEED, SUPPORTED_RATES, Encoding
from realtime.input_streaming import Cut, InputStreamingDefaults, PendingText, StreamingHints, decide
from realtime.session import ServiceError, WordTiming, language_code
from realtime.validation import MAX_SEED, InvalidInput, is_valid_text, parse_json

_CONTEXT_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class ProtocolError(CodedError):
    """A client message the protocol refuses; reported as an error event, the socket carries on."""

    def __init__(self, code: str, message: str, context_id: str | None = None) -> None:
        super().__init__(code, message)
        self.context_id = context_id


# -- commands (client intent, dialect-neutral) ----------------------------------------------------


@dataclass(frozen=True)
class StartContext:
    context_id: str
    voice: str = "default"
    sample_rate: int = 24000
    encoding: Encoding = Encoding.PCM_S16LE
    speed: float = 1.0
    seed: int | None = None
    fixed_length: int | None = None
    streaming: StreamingHints = StreamingHints()  # when buffered text is spoken (input_streaming.py)
    instructions: str | None = None
    language: str | None = None  # primary subtag, lower case (`style_fields` checks it)
    mode: PromptMode | None = None
    bit_rate: int | None = None  # bits/s of a compressed encoding (MP3, Opus); None: the codec's default


@dataclass(frozen=True)
class AppendText:
    context_id: str
    text: str


@dataclass(frozen=True)
class Flush:
    """Speak what is buffered now. With `report`, the flush is numbered (1, 2, ... among the context's
    reported flushes) and `FlushDone` with that number is sent once every text appended before it has
    been spoken (its audio sent), before any later text's audio."""

    context_id: str
    report: bool = False


@dataclass(frozen=True)
class EndContext:
    context_id: str


@dataclass(frozen=True)
class CloseContext:
    """No more input: text already handed to synthesis is spoken to the end, text still buffered is
    dropped, then the context is done. Closing a context that is already closing cancels it."""

    context_id: str


@dataclass(frozen=True)
class CancelContext:
    context_id: str


@dataclass(frozen=True)
class CloseSocket:
    """Close the socket. At once (every context cancelled), or with `drain`: every context closes as
    `CloseContext` does and the socket closes once the last one is done."""

    drain: bool = False


Command = StartContext | AppendText | Flush | EndContext | CloseContext | CancelContext | CloseSocket


# -- events (what the client is told, dialect-neutral) --------------------------------------------


@dataclass(frozen=True)
class AudioOut:
    """One audio chunk of a context, in the sample rate and encoding its `StartContext` asked for."""

    context_id: str
    seq: int
    payload: bytes
    start_s: float
    duration_s: float
    words: tuple[WordTiming, ...]
    final: bool


@dataclass(frozen=True)
class ContextDone:
    context_id: str
    cancelled: bool


@dataclass(frozen=True)
class FlushDone:
    """The audio of everything appended before the context's `flush_id`-th reported `Flush` is sent."""

    context_id: str
    flush_id: int


@dataclass(frozen=True)
class ErrorEvent:
    code: str
    message: str
    context_id: str | None = None


Event = AudioOut | FlushDone | ContextDone | ErrorEvent


# -- actions (what the transport must do) ---------------------------------------------------------


@dataclass(frozen=True)
class Speak:
    """Synthesise `text` next in the context (after its earlier Speaks), then report `speech_done`."""

    context: StartContext
    text: str


@dataclass(frozen=True)
class Abort:
    """Stop the context's synthesis now and drop its queued Speaks, before any later action."""

    context_id: str


@dataclass(frozen=True)
class Wake:
    """Call `AgentProtocol.wake(context_id)` after `after_s` seconds unless another Wake for the context
    replaces this one (buffered text waits on a timer)."""

    context_id: str
    after_s: float


@dataclass(frozen=True)
class Release:
    """The context ended once all its speech was sent: free what the transport holds for it (the
    context id may be reused by a new context afterwards)."""

    context_id: str


@dataclass(frozen=True)
class Send:
    event: Event


@dataclass(frozen=True)
class Close:
    pass


Action = Speak | Abort | Wake | Release | Send | Close


@dataclass(frozen=True)
class ProtocolLimits:
    max_contexts: int = 8
    max_pending_chars: int = 4096  # text received and not yet spoken, per context
    sentence_max_chars: int = 300  # a sentence without punctuation is cut here
    max_queued_texts: int = 64  # texts of one context waiting to be spoken (or being spoken)
    max_flushes_waiting: int = 64  # reported flushes of one context whose text is still being spoken


@dataclass
class _Context:
    start: StartContext
    splitter: StreamingSentenceSplitter
    in_flight: deque[int] = field(default_factory=deque)  # chars of each Speak not yet done
    ending: bool = False
    oldest_at: float | None = None  # when the oldest text still pending arrived
    newest_at: float = 0.0  # when the last piece arrived
    speaks: int = 0
    flushes_reported: int = 0
    flushes_waiting: deque[tuple[int, int]] = field(default_factory=deque)  # (speaks to be done, flush_id)

    @property
    def pending_chars(self) -> int:
        return len(self.splitter.pending) + sum(self.in_flight)


class AgentProtocol:
    """Per-socket protocol state: open contexts, their buffered text and what is being spoken."""

    def __init__(
        self,
        limits: ProtocolLimits,
        voice_exists: Callable[[str], bool],
        streaming: InputStreamingDefaults | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = limits
        self._voice_exists = voice_exists
        self._streaming = streaming or InputStreamingDefaults()
        self._clock = clock
        self._contexts: dict[str, _Context] = {}
        self._draining = False  # a draining CloseSocket: close once the last context is done

    def has_context(self, context_id: str) -> bool:
        return context_id in self._contexts

    def handle(self, command: Command) -> list[Action]:
        """The actions one client command calls for; refusals raise ProtocolError."""
        if isinstance(command, CloseSocket):
            return self._close_socket(command.drain)
        if self._draining:
            raise ProtocolError("socket_closing", "the socket is closing; no new input is accepted")
        if isinstance(command, StartContext):
            return self._start(command)
        context = self._context(command.context_id)
        if isinstance(command, CancelContext):
            return self._cancel(command.context_id)
        if isinstance(command, CloseContext):
            return self._close_context(context)
        if context.ending:
            raise ProtocolError(
                "context_ended",
                f"context {command.context_id!r} was ended; start a new one",
                command.context_id,
            )
        if isinstance(command, AppendText):
            if context.pending_chars + len(command.text) > self._limits.max_pending_chars:
                raise ProtocolError(
                    "text_too_long",
                    f"context {command.context_id!r} would hold more than "
                    f"{self._limits.max_pending_chars} characters not yet spoken",
                    command.context_id,
                )
            now = self._clock()
            if not context.splitter.pending.strip():
                context.oldest_at = now
            context.newest_at = now
            sentences = context.splitter.feed(command.text)
            if sentences:  # what is left arrived with this piece at the earliest
                context.oldest_at = now if context.splitter.pending.strip() else None
            return self._pace(context, sentences)
        report = isinstance(command, Flush) and command.report
        if report and len(context.flushes_waiting) >= self._limits.max_flushes_waiting:
            raise ProtocolError(
                "queue_full",
                f"context {command.context_id!r} already has {self._limits.max_flushes_waiting} flushes "
                "waiting to be done; wait for them",
                command.context_id,
            )
        actions = self._speak(context, context.splitter.flush())
        if report:
            context.flushes_reported += 1
            context.flushes_waiting.append((context.speaks, context.flushes_reported))
            actions.extend(self._flushes_done(context))
        if isinstance(command, EndContext):
            context.ending = True
            actions.extend(self._finish_if_idle(context))
        return actions

    def speaking(self) -> bool:
        """Whether any context has speech queued or in progress."""
        return any(context.in_flight for context in self._contexts.values())

    def holding_text(self) -> list[str]:
        """Contexts holding text that is not being spoken yet (waiting for more, a flush or an end)."""
        return [cid for cid, context in self._contexts.items() if context.splitter.pending.strip()]

    def speech_done(self, context_id: str) -> list[Action]:
        """The transport finished one Speak of `context_id` (all its audio sent)."""
        context = self._contexts.get(context_id)
        if context is None:  # cancelled meanwhile
            return []
        context.in_flight.popleft()
        flushed = self._flushes_done(context)
        if context.ending:
            return flushed + self._finish_if_idle(context)
        return flushed + self._pace(context, [])  # idle now: a clause may be worth speaking

    def wake(self, context_id: str) -> list[Action]:
        """A `Wake` timer of `context_id` fired: speak what has waited long enough."""
        context = self._contexts.get(context_id)
        if context is None or context.ending:
            return []
        return self._pace(context, [])

    def speech_failed(self, context_id: str, code: str, message: str) -> list[Action]:
        """A Speak of `context_id` failed: report it and end the context."""
        if self._contexts.pop(context_id, None) is None:
            return []
        return [Abort(context_id), Send(ErrorEvent(code, message, context_id)), *self._close_if_drained()]

    def _cancel(self, context_id: str) -> list[Action]:
        del self._contexts[context_id]
        return [Abort(context_id), Send(ContextDone(context_id, cancelled=True)), *self._close_if_drained()]

    def _close_context(self, context: _Context) -> list[Action]:
        if context.ending:
            return self._cancel(context.start.context_id)
        context.splitter.flush()  # dropped: never flushed
        context.ending = True
        return self._finish_if_idle(context)

    def _close_socket(self, drain: bool) -> list[Action]:
        if not drain:
            aborts: list[Action] = [Abort(cid) for cid in self._contexts]
            self._contexts.clear()
            return [*aborts, Close()]
        self._draining = True
        actions: list[Action] = []
        for context in list(self._contexts.values()):
            if not context.ending:
                actions.extend(self._close_context(context))
        return actions + self._close_if_drained()

    def _close_if_drained(self) -> list[Action]:
        if self._draining and not self._contexts:
            self._draining = False
            return [Close()]
        return []

    def _start(self, command: StartContext) -> list[Action]:
        cid = command.context_id
        if not _CONTEXT_ID.fullmatch(cid):
            raise ProtocolError(
                "invalid_context_id", "context_id must be 1 to 64 letters, digits, '_', '-' or '.'"
            )
        if cid in self._contexts:
            raise ProtocolError("context_exists", f"context {cid!r} is already open", cid)
        if len(self._contexts) >= self._limits.max_contexts:
            raise ProtocolError(
                "too_many_contexts",
                f"at most {self._limits.max_contexts} contexts may be open on one socket",
                cid,
            )
        if command.sample_rate not in SUPPORTED_RATES:
            raise ProtocolError(
                "unsupported_sample_rate",
                f"sample_rate {command.sample_rate} is not supported; "
                f"use one of {', '.join(map(str, SUPPORTED_RATES))}",
                cid,
            )
        if not self._voice_exists(command.voice):
            raise ProtocolError("voice_not_found", f"there is no voice {command.voice!r}", cid)
        if not MIN_SPEED <= command.speed <= MAX_SPEED:
            message = f"speed must be between {MIN_SPEED} and {MAX_SPEED:g}, got {command.speed}"
            raise ProtocolError("invalid_speed", message, cid)
        try:
            validation.seed(command.seed)
            validation.fixed_length(command.fixed_length)
        except InvalidInput as exc:
            raise ProtocolError(exc.code, exc.message, cid) from None
        self._contexts[cid] = _Context(command, StreamingSentenceSplitter(self._limits.sentence_max_chars))
        return []

    def _context(self, context_id: str) -> _Context:
        context = self._contexts.get(context_id)
        if context is None:
            raise ProtocolError(
                "unknown_context", f"no open context {context_id!r}; send 'start' first", context_id
            )
        return context

    def _pace(self, context: _Context, sentences: list[str]) -> list[Action]:
        """Speak `sentences` and whatever of the pending text the input-streaming policy cuts now;
        a Wake when the policy wants to look again later."""
        splitter, pieces = context.splitter, list(sentences)
        take = {Cut.ALL: splitter.take_all, Cut.WORDS: splitter.take_words, Cut.CLAUSE: splitter.take_clause}
        while True:
            now = self._clock()
            pending = PendingText(
                chars=len("".join(splitter.pending.split())),
                whole_words=splitter.whole_words(),
                clause_words=splitter.clause_words(),
                ends_with_sentence_end=splitter.ends_with_sentence_end,
                oldest_age_s=now - (context.oldest_at if context.oldest_at is not None else now),
                newest_age_s=now - context.newest_at,
                idle=not context.in_flight and not pieces,
                segments_spoken=context.speaks + bool(pieces),
            )
            decision = decide(pending, context.start.streaming, self._streaming)
            taken = [] if decision.cut is Cut.NOTHING else take[decision.cut]()
            if not taken:
                break
            pieces += taken
            # What is left waits afresh (a word still growing is not cut off the moment it arrives).
            context.oldest_at = now if splitter.pending.strip() else None
        actions = self._speak(context, pieces)
        if decision.recheck_after_s is not None:
            actions.append(Wake(context.start.context_id, decision.recheck_after_s))
        return actions

    def _speak(self, context: _Context, sentences: list[str]) -> list[Action]:
        if not sentences:
            return []
        if len(context.in_flight) >= self._limits.max_queued_texts:
            raise ProtocolError(
                "queue_full",
                f"context {context.start.context_id!r} already has {self._limits.max_queued_texts} texts "
                "waiting to be spoken; this text was dropped (send fewer, longer texts, or wait)",
                context.start.context_id,
            )
        text = " ".join(sentences)
        context.in_flight.append(len(text))
        context.speaks += 1
        return [Speak(context.start, text)]

    def _flushes_done(self, context: _Context) -> list[Action]:
        """`FlushDone` for every reported flush whose texts are all spoken now."""
        spoken = context.speaks - len(context.in_flight)
        done: list[Action] = []
        while context.flushes_waiting and context.flushes_waiting[0][0] <= spoken:
            done.append(Send(FlushDone(context.start.context_id, context.flushes_waiting.popleft()[1])))
        return done

    def _finish_if_idle(self, context: _Context) -> list[Action]:
        if context.ending and not context.in_flight:
            del self._contexts[context.start.context_id]
            return [
                Release(context.start.context_id),
                Send(ContextDone(context.start.context_id, cancelled=False)),
                *self._close_if_drained(),
            ]
        return []


class Dialect(Protocol):
    """One wire format over the core: frames in → commands, events → frames out."""

    def decode(self, frame: str | bytes, protocol: AgentProtocol) -> list[Command]:
        """Commands of one client frame; raises ProtocolError for a frame that means nothing valid."""
        ...

    def encode(self, event: Event) -> list[str | bytes]: ...


def parse_json_object(frame: str | bytes) -> dict[str, Any]:
    """A text frame's JSON object; ProtocolError for binary frames, bad JSON and non-objects."""
    if isinstance(frame, bytes):
        raise ProtocolError("binary_not_accepted", "send JSON text frames; binary frames are not accepted")
    try:
        message = parse_json(frame)
    except InvalidInput as exc:
        raise ProtocolError(exc.code, exc.message) from None
    if not isinstance(message, dict):
        raise ProtocolError("invalid_message", "a message must be a JSON object")
    return message


def field_of(
    message: dict[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    default: Any = None,
    required: bool = False,
) -> Any:
    """`message[name]` checked against `kind` (bools are never numbers; integers fit 64 bits; strings
    are valid Unicode); ProtocolError otherwise."""
    value = message.get(name)
    if value is None:
        if required:
            raise ProtocolError("invalid_message", f"'{name}' is required", _error_context(message))
        return default
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ProtocolError("invalid_message", f"'{name}' has the wrong type", _error_context(message))
    if not isinstance(value, kind):
        raise ProtocolError("invalid_message", f"'{name}' has the wrong type", _error_context(message))
    if isinstance(value, int) and not -MAX_SEED - 1 <= value <= MAX_SEED:
        raise ProtocolError("out_of_range", f"'{name}' is out of range", _error_context(message))
    if isinstance(value, str) and not is_valid_text(value):
        raise ProtocolError("invalid_text", f"'{name}' is not valid Unicode (a lone surrogate)",
                            _error_context(message))
    return value


def _error_context(message: dict[str, Any]) -> str | None:
    """The context an error about `message` names: its `context_id` where that is valid text (worked out
    only for an error: a start has a dozen fields)."""
    context_id = message.get("context_id")
    return context_id if isinstance(context_id, str) and is_valid_text(context_id) else None


def streaming_hints(context_id: str | None, **hints: Any) -> StreamingHints:
    """A client's input-streaming hints, or ProtocolError(invalid_message) naming what is wrong."""
    try:
        return StreamingHints(**hints)
    except ValueError as exc:
        raise ProtocolError("invalid_message", str(exc), context_id) from None


def style_fields(message: dict[str, Any], context_id: str) -> dict[str, Any]:
    """`StartContext`'s `instructions`, `language` and `mode` from a start message (absent: None);
    ProtocolError (`invalid_message`, `invalid_language`, `invalid_mode`) for bad values."""
    language = field_of(message, "language", str)
    mode = field_of(message, "mode", str)
    try:
        parsed_mode = PromptMode(mode) if mode is not None else None
    except ValueError:
        modes = ", ".join(m.value for m in PromptMode)
        raise ProtocolError("invalid_mode", f"mode must be one of {modes}", context_id) from None
    try:
        code = language_code(language) if language is not None else None
    except ServiceError as exc:
        raise ProtocolError(exc.code, exc.message, context_id) from None
    return {"instructions": field_of(message, "instructions", str), "language": code, "mode": parsed_mode}
