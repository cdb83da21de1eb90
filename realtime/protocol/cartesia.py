"""A dialect of the agents' protocol that speaks Cartesia's TTS websocket (`/cartesia/tts/websocket`).

Clients written for Cartesia (Pipecat's and LiveKit's plugins, Cartesia's SDK) work when pointed at
`ws://HOST:PORT/cartesia/tts/websocket`; `api_key` and `cartesia_version` query parameters are
accepted and ignored. What is mapped:

- A generation request `{"context_id", "transcript", "voice": {"mode": "id", "id"}, "output_format":
  {"container": "raw", "encoding": "pcm_s16le" | "pcm_f32le" | "pcm_mulaw", "sample_rate"},
  "continue", "add_timestamps", "flush"?, "model_id", "language"}` opens the context on its first
  input (voice and format come from it; `model_id` and `language` are ignored), appends `transcript`,
  speaks what is buffered on `"flush": true`, and ends the context on `"continue": false` (the default).
- `{"context_id", "cancel": true}` cancels the context.
- Out: `{"type": "chunk", "data": base64 audio, "done": false, "status_code": 206, "step_time",
  "context_id"}`; with `add_timestamps`, `{"type": "timestamps", "word_timestamps": {"words", "start",
  "end"}, ...}`; `{"type": "done", "done": true, "status_code": 206, "context_id"}` after the last
  audio; `{"type": "error", "done": true, "status_code", "error", "title", "message", "context_id"}`.
  A cancelled context gets no further messages.
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
    Command,
    ContextDone,
    EndContext,
    Event,
    Flush,
    ProtocolError,
    StartContext,
    field_of,
    parse_json_object,
    streaming_hints,
)

_ENCODINGS = {"pcm_s16le": Encoding.PCM_S16LE, "pcm_f32le": Encoding.PCM_F32LE, "pcm_mulaw": Encoding.MULAW}
_STATUS_FOR_CODE = {"busy": 429, "internal_error": 500}


class CartesiaDialect:
    """Cartesia's message shapes over the core; remembers which contexts asked for timestamps."""

    def __init__(self) -> None:
        self._timestamps: set[str] = set()

    def decode(self, frame: str | bytes, protocol: AgentProtocol) -> list[Command]:
        message = parse_json_object(frame)
        context_id = field_of(message, "context_id", str, required=True)
        if field_of(message, "cancel", bool, False):
            self._timestamps.discard(context_id)
            return [CancelContext(context_id)]
        commands: list[Command] = []
        if not protocol.has_context(context_id):
            commands.append(self._start(message, context_id))
        transcript = field_of(message, "transcript", str, "")
        if transcript:
            commands.append(AppendText(context_id, transcript))
        if field_of(message, "flush", bool, False):
            commands.append(Flush(context_id))
        if not field_of(message, "continue", bool, False):
            commands.append(EndContext(context_id))
        return commands

    def _start(self, message: dict[str, Any], context_id: str) -> StartContext:
        voice = field_of(message, "voice", dict, {})
        voice_id = voice.get("id", "default")
        if voice.get("mode", "id") != "id" or not isinstance(voice_id, str):
            raise ProtocolError(
                "invalid_message", "voice must be {'mode': 'id', 'id': <voice id>}", context_id
            )
        output = field_of(message, "output_format", dict, {})
        if output.get("container", "raw") != "raw":
            raise ProtocolError("unsupported_encoding", "only the 'raw' container is supported", context_id)
        encoding = _ENCODINGS.get(output.get("encoding", "pcm_s16le"))
        if encoding is None:
            raise ProtocolError(
                "unsupported_encoding",
                f"encoding {output.get('encoding')!r} is not supported; use one of {', '.join(_ENCODINGS)}",
                context_id,
            )
        rate = output.get("sample_rate", 24000)
        if isinstance(rate, bool) or not isinstance(rate, int):
            raise ProtocolError("invalid_message", "output_format.sample_rate must be an integer", context_id)
        if field_of(message, "add_timestamps", bool, False):
            self._timestamps.add(context_id)
        speed = field_of(message, "speed", (int, float), 1.0)
        return StartContext(
            context_id,
            voice=voice_id,
            sample_rate=rate,
            encoding=encoding,
            speed=float(speed),
            streaming=streaming_hints(
                context_id, max_buffer_delay_ms=field_of(message, "max_buffer_delay_ms", int)
            ),
        )

    def encode(self, event: Event) -> list[str | bytes]:
        if isinstance(event, AudioOut):
            frames: list[str | bytes] = []
            if event.words and event.context_id in self._timestamps:
                frames.append(
                    json.dumps(
                        {
                            "type": "timestamps",
                            "done": False,
                            "status_code": 206,
                            "context_id": event.context_id,
                            "word_timestamps": {
                                "words": [w.word for w in event.words],
                                "start": [round(w.start_s, 3) for w in event.words],
                                "end": [round(w.end_s, 3) for w in event.words],
                            },
                        }
                    )
                )
            frames.append(
                json.dumps(
                    {
                        "type": "chunk",
                        "data": base64.b64encode(event.payload).decode("ascii"),
                        "done": False,
                        "status_code": 206,
                        "step_time": round(event.duration_s * 1000, 1),
                        "context_id": event.context_id,
                    }
                )
            )
            return frames
        if isinstance(event, ContextDone):
            self._timestamps.discard(event.context_id)
            if event.cancelled:
                return []
            return [
                json.dumps({"type": "done", "done": True, "status_code": 206, "context_id": event.context_id})
            ]
        if event.context_id is not None:
            self._timestamps.discard(event.context_id)
        return [
            json.dumps(
                {
                    "type": "error",
                    "done": True,
                    "status_code": _STATUS_FOR_CODE.get(event.code, 400),
                    "error": event.message,
                    "title": event.code,
                    "message": event.message,
                    "context_id": event.context_id,
                }
            )
        ]
