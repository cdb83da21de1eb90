"""A dialect of the agents' protocol that speaks ElevenLabs' text-to-speech websockets.

Both endpoints are served at ElevenLabs' paths, so clients pointed at `ws://HOST:PORT` instead of
`wss://api.elevenlabs.io` work (`model_id`, `xi_api_key`, voice settings and generation config are
accepted and ignored):

- `/v1/text-to-speech/{voice_id}/stream-input?output_format=pcm_24000`: one utterance per socket.
  Every `{"text": ...}` appends text (the first one, usually `" "`, opens the stream);
  `"flush": true` speaks what is buffered; `{"text": ""}` ends the input.
- `/v1/text-to-speech/{voice_id}/multi-stream-input?output_format=...`: several contexts, each
  message naming its `context_id` (a missing one means `default`). `{"text", "context_id"}`
  appends (an empty text keeps a context alive), `"flush": true` speaks the buffer,
  `{"context_id", "close_context": true}` cancels the context at once (barge-in),
  `{"close_socket": true}` ends every context and the socket.

`language_code` (query parameter, ISO 639-1) is the text's language: cross-lingual synthesis when it
differs from the voice's.

`output_format` is `pcm_<rate>` (16-bit PCM at 8000, 16000, 22050, 24000, 44100 or 48000) or
`ulaw_8000`; the default is `pcm_24000` (MP3 formats are refused). Out: `{"audio": base64,
"isFinal": false, "alignment": {"chars", "charStartTimesMs", "charDurationsMs"}}` per chunk (times
relative to the chunk, as ElevenLabs sends them), then `{"audio": null, "isFinal": true}` when the
stream is done; on the multi-context endpoint each message also carries `contextId`. Errors:
`{"error": code, "message": sentence}` (with `contextId` where it applies).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from realtime.audio import Encoding
from realtime.protocol.core import (
    AgentProtocol,
    AppendText,
    AudioOut,
    CancelContext,
    CloseSocket,
    Command,
    ContextDone,
    EndContext,
    Event,
    Flush,
    ProtocolError,
    StartContext,
    field_of,
    parse_json_object,
    style_fields,
)
from realtime.session import WordTiming

SINGLE_CONTEXT = "default"


def parse_output_format(output_format: str) -> tuple[int, Encoding]:
    """(sample rate, encoding) of an ElevenLabs `output_format`; ProtocolError for the ones we lack."""
    kind, _, rate = output_format.partition("_")
    if kind == "pcm" and rate.isdigit():
        return int(rate), Encoding.PCM_S16LE
    if output_format == "ulaw_8000":
        return 8000, Encoding.MULAW
    raise ProtocolError(
        "unsupported_encoding",
        f"output_format {output_format!r} is not supported; use pcm_<rate> or ulaw_8000",
    )


def char_alignment(words: tuple[WordTiming, ...], chunk_start_s: float) -> dict[str, list[Any]]:
    """Character timings (ms from the chunk start) spread evenly over each word, a space between words."""
    chars: list[str] = []
    starts: list[int] = []
    durations: list[int] = []
    for index, word in enumerate(words):
        text = word.word if index == 0 else " " + word.word
        step = (word.end_s - word.start_s) / max(len(text), 1)
        for position, char in enumerate(text):
            chars.append(char)
            starts.append(round((word.start_s - chunk_start_s + position * step) * 1000))
            durations.append(round(step * 1000))
    return {"chars": chars, "charStartTimesMs": starts, "charDurationsMs": durations}


class ElevenLabsDialect:
    """ElevenLabs' message shapes over the core, for one voice and output format per socket."""

    def __init__(self, voice_id: str, output_format: str, multi_context: bool,
                 language_code: str | None = None) -> None:
        self._voice_id = voice_id
        self._rate, self._encoding = parse_output_format(output_format)
        self._multi = multi_context
        self._language = style_fields({"language": language_code}, SINGLE_CONTEXT)["language"]

    def decode(self, frame: str | bytes, protocol: AgentProtocol) -> list[Command]:
        message = parse_json_object(frame)
        if self._multi and field_of(message, "close_socket", bool, False):
            return [CloseSocket()]
        context_id = field_of(message, "context_id", str, SINGLE_CONTEXT) if self._multi else SINGLE_CONTEXT
        if self._multi and field_of(message, "close_context", bool, False):
            return [CancelContext(context_id)]
        text = field_of(message, "text", str, None)
        flush = field_of(message, "flush", bool, False)
        if text is None and not flush:
            raise ProtocolError("invalid_message", "a message needs 'text' (or 'flush')", context_id)
        commands: list[Command] = []
        if not protocol.has_context(context_id):
            commands.append(
                StartContext(
                    context_id, voice=self._voice_id, sample_rate=self._rate, encoding=self._encoding,
                    language=self._language,
                )
            )
        if text:
            commands.append(AppendText(context_id, text))
        if flush:
            commands.append(Flush(context_id))
        if text == "" and not self._multi:
            commands.append(EndContext(context_id))
        return commands

    def encode(self, event: Event) -> list[str | bytes]:
        if isinstance(event, AudioOut):
            message: dict[str, Any] = {
                "audio": base64.b64encode(event.payload).decode("ascii"),
                "isFinal": False,
                "alignment": char_alignment(event.words, event.start_s) if event.words else None,
            }
            return [json.dumps(self._tag(message, event.context_id))]
        if isinstance(event, ContextDone):
            if event.cancelled and not self._multi:
                return []
            return [json.dumps(self._tag({"audio": None, "isFinal": True}, event.context_id))]
        message = {"error": event.code, "message": event.message}
        return [json.dumps(self._tag(message, event.context_id) if event.context_id else message)]

    def _tag(self, message: dict[str, Any], context_id: str) -> dict[str, Any]:
        return {**message, "contextId": context_id} if self._multi else message
