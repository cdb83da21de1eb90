"""The native wire format of the agents' websocket (`/v1/ws`), a dialect over the protocol core.

Client → server: JSON text frames, each an object with a `type`. Several contexts (independent
utterance streams, e.g. one per agent turn) may be open on one socket at once.

- `{"type": "start", "context_id": "c1", "voice": "default", "sample_rate": 24000,
  "encoding": "pcm_s16le", "speed": 1.0, "seed": 7}` opens a context. `context_id`: 1–64 characters
  of letters, digits, `_`, `-`, `.`; `sample_rate`: 8000, 16000, 22050, 24000 (default), 44100 or
  48000; `encoding`: `pcm_s16le` (default), `pcm_f32le` or `mulaw` (G.711 µ-law); `voice` defaults
  to `default`;
  `speed` (0.25–4), `seed` and `fixed_length` (speech tokens per sentence, for tests) are optional;
  so are `instructions` (a style in words, e.g. "Speak slowly and sadly.": the instruct2 mode),
  `language` (ISO 639 code of the text: cross-lingual when it differs from the voice's) and `mode`
  (`zero_shot`, `cross_lingual` or `instruct2`, to choose explicitly). See README "Modes".
  Input-streaming knobs (optional, see `realtime/input_streaming.py`): `max_buffer_delay_ms` (the
  longest text waits unspoken, default 3000; 0 speaks each `text` message as it arrives, for clients
  that send whole sentences), `min_words` (speak as soon as this many whole words are buffered) and
  `clause_min_words` (the first words of a turn are spoken at a clause boundary once this many came
  before it, default 5; 0 waits for sentence ends).
- `{"type": "text", "context_id": "c1", "text": "Hello wor"}` appends text; send an LLM's tokens as they
  come, each with the whitespace it carries (pieces are joined exactly as sent). Each sentence is
  spoken as soon as it is complete: terminal punctuation followed by whitespace, by a piece starting
  a new sentence (`"today."` then `"Shall"`), or by nothing for 150 ms; before the first sentence
  ends, a long enough first clause is spoken on its own. Sentences of one context are spoken in
  order, audio continuous.
- `{"type": "flush", "context_id": "c1"}` speaks whatever is buffered now, even without punctuation.
- `{"type": "end", "context_id": "c1"}` flushes and closes the context once everything is spoken.
- `{"type": "cancel", "context_id": "c1"}` stops the context at once (barge-in): synthesis stops
  within one chunk, buffered text is dropped and no more audio of it is sent.
- `{"type": "close"}` cancels every context and closes the socket (code 1000).

Server → client:

- Audio as binary frames: byte 0 is the frame kind `0x01`; byte 1 is `n`, the length in bytes of the
  UTF-8 context id that follows in bytes `2 .. 2+n`; then the chunk's `seq` as a 4-byte big-endian
  unsigned integer; the rest is audio in the context's encoding and sample rate (mono; 2 bytes per
  sample for `pcm_s16le`, 4 for `pcm_f32le`, 1 for `mulaw`).
- Right after each audio frame, its metadata as JSON: `{"type": "chunk", "context_id", "seq",
  "start_s", "duration_s", "words": [{"word", "start_s", "end_s", "estimated"}], "final"}`. `seq`
  counts the context's chunks from 0; times are seconds from the start of the context's audio;
  `words` are the words starting in this chunk, timed exactly at sentence boundaries and estimated
  within a sentence (`estimated: true`); `final` marks the last chunk of one spoken text.
- `{"type": "done", "context_id", "cancelled": false}` after the last audio of an ended context;
  `{"type": "done", "context_id", "cancelled": true}` acknowledges a cancel (nothing follows).
- `{"type": "error", "context_id": "c1" | null, "code", "message"}`: `code` is machine readable,
  `message` a sentence. Errors about a message (`invalid_json`, `unknown_type`, `invalid_message`,
  `binary_not_accepted`, `unknown_context`, `context_exists`, ...) leave the socket and every other
  context as they were; an error while synthesising (`busy`, `voice_not_found`, ...) ends its context.
"""

from __future__ import annotations

import json
import struct
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
    FlushDone,
    ProtocolError,
    StartContext,
    field_of,
    parse_json_object,
    streaming_hints,
    style_fields,
)
from realtime.session import WordTiming

AUDIO_FRAME_KIND = 0x01
_NATIVE_ENCODINGS = {e.value: e for e in (Encoding.PCM_S16LE, Encoding.PCM_F32LE, Encoding.MULAW)}


def words_json(words: tuple[WordTiming, ...]) -> list[dict[str, Any]]:
    return [
        {"word": w.word, "start_s": round(w.start_s, 3), "end_s": round(w.end_s, 3), "estimated": w.estimated}
        for w in words
    ]


def audio_frame(context_id: str, seq: int, payload: bytes) -> bytes:
    """The native binary audio frame (see the module docstring)."""
    cid = context_id.encode()
    return bytes((AUDIO_FRAME_KIND, len(cid))) + cid + struct.pack(">I", seq) + payload


def parse_audio_frame(frame: bytes) -> tuple[str, int, bytes]:
    """(context_id, seq, payload) of a native audio frame; ValueError if it is not one."""
    if len(frame) < 2 or frame[0] != AUDIO_FRAME_KIND or len(frame) < 6 + frame[1]:
        raise ValueError("not an audio frame")
    n = frame[1]
    (seq,) = struct.unpack(">I", frame[2 + n : 6 + n])
    return frame[2 : 2 + n].decode(), seq, frame[6 + n :]


class NativeDialect:
    """The `/v1/ws` wire format described in this module's docstring."""

    def decode(self, frame: str | bytes, protocol: AgentProtocol) -> list[Command]:
        message = parse_json_object(frame)
        kind = message.get("type")
        if kind == "close":
            return [CloseSocket()]
        if kind not in ("start", "text", "flush", "end", "cancel"):
            raise ProtocolError(
                "unknown_type",
                f"unknown message type {kind!r}; expected start, text, flush, end, cancel or close",
            )
        context_id = field_of(message, "context_id", str, required=True)
        if kind == "start":
            encoding = field_of(message, "encoding", str, "pcm_s16le")
            try:
                parsed_encoding = _NATIVE_ENCODINGS[encoding]
            except KeyError:
                raise ProtocolError(
                    "unsupported_encoding",
                    f"encoding {encoding!r} is not supported; use pcm_s16le, pcm_f32le or mulaw",
                    context_id,
                ) from None
            return [
                StartContext(
                    context_id=context_id,
                    voice=field_of(message, "voice", str, "default"),
                    sample_rate=field_of(message, "sample_rate", int, 24000),
                    encoding=parsed_encoding,
                    speed=float(field_of(message, "speed", (int, float), 1.0)),
                    seed=field_of(message, "seed", int),
                    fixed_length=field_of(message, "fixed_length", int),
                    streaming=streaming_hints(
                        context_id,
                        max_buffer_delay_ms=field_of(message, "max_buffer_delay_ms", int),
                        min_words=field_of(message, "min_words", int),
                        clause_min_words=field_of(message, "clause_min_words", int),
                    ),
                    **style_fields(message, context_id),
                )
            ]
        if kind == "text":
            return [AppendText(context_id, field_of(message, "text", str, required=True))]
        if kind == "flush":
            return [Flush(context_id)]
        if kind == "end":
            return [EndContext(context_id)]
        return [CancelContext(context_id)]

    def encode(self, event: Event) -> list[str | bytes]:
        if isinstance(event, AudioOut):
            meta = {
                "type": "chunk",
                "context_id": event.context_id,
                "seq": event.seq,
                "start_s": round(event.start_s, 4),
                "duration_s": round(event.duration_s, 4),
                "words": words_json(event.words),
                "final": event.final,
            }
            return [audio_frame(event.context_id, event.seq, event.payload), json.dumps(meta)]
        if isinstance(event, FlushDone):  # the native flush is not reported
            return []
        if isinstance(event, ContextDone):
            return [
                json.dumps({"type": "done", "context_id": event.context_id, "cancelled": event.cancelled})
            ]
        return [
            json.dumps(
                {
                    "type": "error",
                    "context_id": event.context_id,
                    "code": event.code,
                    "message": event.message,
                }
            )
        ]
