"""A dialect of the agents' protocol that speaks ElevenLabs' text-to-speech websockets.

Both endpoints are served at ElevenLabs' paths, so clients pointed at `ws://HOST:PORT` instead of
`wss://api.elevenlabs.io` work. `model_id`, `xi_api_key`/`authorization`, `voice_settings` other than
`speed`, `sync_alignment` (alignment is always sent), `inactivity_timeout`, `enable_logging`
and the normalisation switches are accepted and ignored. `language_code` (URL parameter, ISO 639-1)
is the text's language: cross-lingual synthesis when it differs from the voice's.

- `/v1/text-to-speech/{voice_id}/stream-input`: one utterance per socket. The first message (usually
  `{"text": " ", "voice_settings": ..., "generation_config": ...}`) opens it; every `{"text": ...}`
  appends; `"flush": true` speaks what is buffered; `{"text": ""}` ends the input: everything buffered
  is spoken, `{"isFinal": true}` follows the last audio and the server closes the socket (1000).
- `/v1/text-to-speech/{voice_id}/multi-stream-input`: several contexts, each message naming its
  `context_id` (a missing one means `default`). A message with text for an unknown context opens it;
  `{"text": "", "context_id"}` (or `{"text": ""}` alone) is a keep-alive and opens nothing;
  `"flush": true` speaks the context's buffer; `{"context_id", "close_context": true}` closes the
  context: text already flushed (or already being spoken) is spoken to the end and then `isFinal`
  is sent, text never flushed is dropped; closing a context that is already closing cancels it at
  once (barge-in). `{"close_socket": true}` closes every context that way and then the socket.

When buffered text is spoken is the protocol core's input-streaming policy
(`realtime/input_streaming.py`), with ElevenLabs' hints mapped onto it: `flush` speaks the context's
buffer now; `auto_mode=true` (URL parameter: the client sends whole phrases) speaks every message as
it arrives (`max_buffer_delay_ms` 0); `generation_config.chunk_length_schedule` is the policy's
character schedule (the k-th segment waits for `schedule[k]` characters, whole words only);
`try_trigger_generation` asks for that schedule's threshold to be tried now, which the policy does
on every message anyway. Without hints the server's defaults apply (sentences as soon as they end,
a first clause early, nothing held longer than a few seconds). `voice_settings.speed` sets the speed.

`output_format` (URL parameter, default `mp3_44100_128`): `pcm_<rate>` (16-bit PCM at 8000, 16000,
22050, 24000, 32000, 44100 or 48000 Hz), `ulaw_8000`, `alaw_8000`, `mp3_<rate>_<kbps>` and
`opus_48000_<kbps>` (Ogg Opus). Out, per audio chunk: `{"audio": base64, "alignment": {"chars",
"charStartTimesMs", "charDurationsMs"}, "normalizedAlignment": (the same)}`: the characters that
start in this chunk, a space before every word but the first (all chunks together spell the text
exactly), times in ms from the end of the previous alignment (the chunk's start, unless chunks
before it had none), the last character lasting to the chunk's end; both are `null` on a chunk
where no character starts (a long word, a pause, the tail); then `{"audio": null, "isFinal": true}`
when the context is done. On the multi-context endpoint every message also carries `contextId`. Errors:
`{"error": code, "message": sentence}` (with `contextId` where it applies).
"""

from __future__ import annotations

import base64
import json
from collections import deque
from dataclasses import dataclass
from typing import Any

from realtime.audio import SUPPORTED_RATES, Encoding
from realtime.protocol.core import (
    AgentProtocol,
    AppendText,
    AudioOut,
    CloseContext,
    CloseSocket,
    Command,
    ContextDone,
    EndContext,
    Event,
    Flush,
    FlushDone,
    ProtocolError,
    StartContext,
    field_of,
    parse_json_object,
    streaming_hints,
    style_fields,
)
from realtime.session import WordTiming

SINGLE_CONTEXT = "default"
DEFAULT_OUTPUT_FORMAT = "mp3_44100_128"
_MP3_KBPS = range(8, 321)
_OPUS_KBPS = range(6, 257)


def _is_number(text: str) -> bool:
    """ASCII digits of a plausible size (`int` refuses other Unicode digits and 4300+ of them)."""
    return text.isascii() and text.isdigit() and len(text) <= 6


@dataclass(frozen=True)
class OutputFormat:
    """One ElevenLabs `output_format`: what the chunks are encoded as."""

    name: str
    sample_rate: int
    encoding: Encoding
    bit_rate: int | None  # bits/s of MP3 or Opus
    content_type: str


def parse_output_format(name: str) -> OutputFormat:
    """The `OutputFormat` of an ElevenLabs `output_format`; ProtocolError for the ones we lack."""
    kind, _, rest = name.partition("_")
    rate_text, _, kbps_text = rest.partition("_")
    rate = int(rate_text) if _is_number(rate_text) else 0
    kbps = int(kbps_text) if _is_number(kbps_text) else None
    if kind == "pcm" and rate in SUPPORTED_RATES and not kbps_text:
        return OutputFormat(name, rate, Encoding.PCM_S16LE, None, "audio/pcm")
    if name == "ulaw_8000":
        return OutputFormat(name, 8000, Encoding.MULAW, None, "audio/basic")
    if name == "alaw_8000":
        return OutputFormat(name, 8000, Encoding.ALAW, None, "audio/x-alaw-basic")
    if kind == "mp3" and rate in SUPPORTED_RATES and (not kbps_text or kbps in _MP3_KBPS):
        return OutputFormat(name, rate, Encoding.MP3, (kbps or 128) * 1000, "audio/mpeg")
    if kind == "opus" and rate == 48000 and kbps in _OPUS_KBPS:
        return OutputFormat(name, rate, Encoding.OPUS, (kbps or 64) * 1000, "audio/ogg")
    raise ProtocolError(
        "unsupported_output_format",
        f"output_format {name!r} is not supported; use pcm_<rate>, ulaw_8000, alaw_8000, "
        "mp3_<rate>_<kbps> or opus_48000_<kbps>",
    )


class CharAligner:
    """ElevenLabs' character alignment of one context's chunks, from the words the session timed.

    Each word's characters are spread evenly over the word and a space (spanning the pause) goes before
    every word but the first, so the chunks' characters spell the words exactly, one space between
    them. Every character is reported in the chunk where it starts (a word timed before the chunk it
    arrives with starts at 0, never a negative time). A chunk where no character starts has no
    alignment (`None`): the next alignment's times count from the end of the last one reported, and
    its last character lasts to its chunk's end, so a client that advances its clock by each
    alignment's extent (Pipecat) stays in step with the audio. Times are rounded to ms on the
    context's clock, so those extents add up without drift.
    """

    def __init__(self) -> None:
        self._pending: deque[tuple[str, float]] = deque()  # (char, start seconds), not yet reported
        self._words = 0
        self._last_word_end = 0.0
        self._covered_ms = 0  # the context's audio up to here is covered by alignments already sent

    def chunk(
        self, words: tuple[WordTiming, ...], start_s: float, duration_s: float, final: bool
    ) -> dict[str, Any] | None:
        for word in words:
            if self._words:
                self._pending.append((" ", min(self._last_word_end, word.start_s)))
            step = (word.end_s - word.start_s) / max(len(word.word), 1)
            self._pending.extend((char, word.start_s + i * step) for i, char in enumerate(word.word))
            self._last_word_end = word.end_s
            self._words += 1
        end_s = start_s + duration_s
        taken: list[tuple[str, float]] = []
        while self._pending and (final or self._pending[0][1] < end_s):
            taken.append(self._pending.popleft())
        if not taken:
            return None
        origin_ms = self._covered_ms
        extent_ms = max(round(end_s * 1000) - origin_ms, 0)
        starts: list[int] = []
        for _, char_start in taken:
            relative = min(max(round(char_start * 1000) - origin_ms, 0), extent_ms)
            starts.append(max(relative, starts[-1]) if starts else relative)
        durations = [b - a for a, b in zip(starts, [*starts[1:], extent_ms], strict=True)]
        self._covered_ms = origin_ms + extent_ms
        return {"chars": [c for c, _ in taken], "charStartTimesMs": starts, "charDurationsMs": durations}


class ElevenLabsDialect:
    """ElevenLabs' message shapes over the core, for one voice and output format per socket."""

    def __init__(
        self,
        voice_id: str,
        output_format: str,
        multi_context: bool,
        auto_mode: bool = False,
        language_code: str | None = None,
    ) -> None:
        self._voice_id = voice_id
        self._format = parse_output_format(output_format)
        self._multi = multi_context
        self._language = style_fields({"language": language_code}, SINGLE_CONTEXT)["language"]
        self._auto_mode = auto_mode
        self._aligners: dict[str, CharAligner] = {}  # per context, until it is done

    def decode(self, frame: str | bytes, protocol: AgentProtocol) -> list[Command]:
        message = parse_json_object(frame)
        if self._multi and field_of(message, "close_socket", bool, False):
            return [CloseSocket(drain=True)]
        context_id = field_of(message, "context_id", str, SINGLE_CONTEXT) if self._multi else SINGLE_CONTEXT
        exists = protocol.has_context(context_id)
        if self._multi and field_of(message, "close_context", bool, False):
            return [CloseContext(context_id)] if exists else []
        text = field_of(message, "text", str, None)
        flush = field_of(message, "flush", bool, False)
        if text is None and not flush:
            raise ProtocolError("invalid_message", "a message needs 'text' (or 'flush')", context_id)
        if not self._multi and text == "":  # end of input
            return [EndContext(context_id), CloseSocket(drain=True)] if exists else [CloseSocket(drain=True)]
        if not text:  # a keep-alive, or a flush of what is buffered
            return [Flush(context_id)] if flush and exists else []
        commands: list[Command] = [] if exists else [self._start(context_id, message)]
        commands.append(AppendText(context_id, text))
        if flush:
            commands.append(Flush(context_id))
        return commands

    def _start(self, context_id: str, message: dict[str, Any]) -> StartContext:
        settings = field_of(message, "voice_settings", dict, {})
        speed = settings.get("speed")
        if isinstance(speed, bool) or not isinstance(speed, int | float | None):
            raise ProtocolError("invalid_message", "'voice_settings.speed' must be a number", context_id)
        config = field_of(message, "generation_config", dict, {})
        schedule = config.get("chunk_length_schedule")
        if schedule is not None and (
            not isinstance(schedule, list)
            or not schedule
            or not all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 1 for v in schedule)
        ):
            raise ProtocolError(
                "invalid_message",
                "'generation_config.chunk_length_schedule' must be a list of positive numbers",
                context_id,
            )
        self._aligners[context_id] = CharAligner()
        return StartContext(
            context_id,
            voice=self._voice_id,
            sample_rate=self._format.sample_rate,
            encoding=self._format.encoding,
            bit_rate=self._format.bit_rate,
            speed=float(speed) if speed is not None else 1.0,
            language=self._language,
            streaming=streaming_hints(
                context_id,
                max_buffer_delay_ms=0 if self._auto_mode else None,
                char_schedule=tuple(round(chars) for chars in schedule or ()),
            ),
        )

    def encode(self, event: Event) -> list[str | bytes]:
        if isinstance(event, AudioOut):
            aligner = self._aligners.setdefault(event.context_id, CharAligner())
            alignment = aligner.chunk(event.words, event.start_s, event.duration_s, event.final)
            message: dict[str, Any] = {
                "audio": base64.b64encode(event.payload).decode("ascii"),
                "alignment": alignment,
                "normalizedAlignment": alignment,
            }
            return [json.dumps(self._tag(message, event.context_id))]
        if isinstance(event, FlushDone):  # ElevenLabs' flush is not reported
            return []
        if event.context_id is not None:
            self._aligners.pop(event.context_id, None)
        if isinstance(event, ContextDone):
            if event.cancelled and not self._multi:
                return []
            return [json.dumps(self._tag({"audio": None, "isFinal": True}, event.context_id))]
        message = {"error": event.code, "message": event.message}
        return [json.dumps(self._tag(message, event.context_id) if event.context_id else message)]

    def _tag(self, message: dict[str, Any], context_id: str) -> dict[str, Any]:
        return {**message, "contextId": context_id} if self._multi else message
