"""A dialect of the agents' protocol that speaks Cartesia's TTS API: the websocket
(`/cartesia/tts/websocket`) and, through `realtime/transports/cartesia_http.py`, `POST /cartesia/tts/bytes`
and `/cartesia/tts/sse`.

Clients written for Cartesia (Pipecat's and LiveKit's plugins, Cartesia's SDK) work when their base URL
is `http://HOST:PORT/cartesia` (the websocket: `ws://HOST:PORT/cartesia`); `api_key` /
`cartesia_version` query parameters and the `X-API-Key`, `Cartesia-Version` headers are accepted and
ignored. What is mapped:

- A generation request `{"context_id", "transcript", "voice": {"mode": "id", "id"}, "output_format":
  {"container": "raw", "encoding": "pcm_s16le" | "pcm_f32le" | "pcm_mulaw" | "pcm_alaw", "sample_rate"},
  "continue", "add_timestamps", "flush"?, "max_buffer_delay_ms"?, "generation_config": {"speed"}?,
  "model_id", "language"}` opens the context on its first input (voice, format, speed and buffering
  come from it; `model_id` and `volume` are ignored), appends `transcript`, speaks what is buffered on
  `"flush": true`, and ends the context on `"continue": false` (the default). Flushes are numbered per
  context from 1 (the core's reported flushes): audio of text sent before the first flush has
  `flush_id` 1, after it 2, and so on. Transcripts of one context are joined exactly as sent and
  spoken as the input-streaming policy decides (`realtime/input_streaming.py`): `max_buffer_delay_ms`
  0 speaks each one at once, otherwise sentences are spoken as they end and the rest within
  `max_buffer_delay_ms` (default 3000).
  `generation_config.speed` is a tempo multiplier; the older top-level `speed` (-1..1 or
  `slowest`..`fastest`) is mapped onto one.
  `language` other than the voice's speaks cross-lingually. An emotion (`generation_config.emotion`,
  or sonic-2's `voice.__experimental_controls.emotion` list of `name:level`) that CosyVoice2 was
  instructed with (anger, positivity, sadness and their sonic-3 names, `EMOTION_INSTRUCTIONS`) becomes
  an instruct2 instruction; other emotions and the levels are ignored.
- `{"context_id", "cancel": true}` cancels the context (its synthesis stops, the slot is freed).
- Out: `{"type": "chunk", "data": base64 audio, "done": false, "status_code": 206, "step_time",
  "context_id", "flush_id"}`; with `add_timestamps`, `{"type": "timestamps", "word_timestamps":
  {"words", "start", "end"}, "flush_id", ...}` before the chunk where those words start (seconds from
  the context's first audio); `{"type": "flush_done", "done": false, "flush_done": true, "flush_id",
  "status_code": 206, "context_id"}` once the audio of every text sent before that flush is out;
  `{"type": "done", "done": true, "status_code": 206, "context_id"}` after the last audio;
  `{"type": "error", "done": true, "status_code", "error_code", "title", "message", "context_id"}`.
  A cancelled context gets no further messages.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from realtime.audio import MAX_SPEED, MIN_SPEED, SUPPORTED_RATES, Encoding
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
    FlushDone,
    ProtocolError,
    StartContext,
    field_of,
    parse_json_object,
    streaming_hints,
    style_fields,
)

_ENCODINGS = {
    "pcm_s16le": Encoding.PCM_S16LE, "pcm_f32le": Encoding.PCM_F32LE, "pcm_mulaw": Encoding.MULAW,
    "pcm_alaw": Encoding.ALAW,
}
CONTAINERS = ("raw", "wav", "mp3")
_SPEED_WORDS = {"slowest": 0.5, "slow": 0.75, "normal": 1.0, "fast": 1.33, "fastest": 2.0}
_STATUS_FOR_CODE = {"busy": 429, "internal_error": 500}
# Cartesia emotion names → the reference's instruct2 wording for that emotion (cosyvoice/utils/common.py).
_HAPPY, _SAD, _ANGRY = "请非常开心地说一句话。", "请非常伤心地说一句话。", "请非常生气地说一句话。"
EMOTION_INSTRUCTIONS = {
    "positivity": _HAPPY, "happy": _HAPPY, "excited": _HAPPY, "joyful": _HAPPY, "enthusiastic": _HAPPY,
    "sadness": _SAD, "sad": _SAD, "melancholic": _SAD, "disappointed": _SAD,
    "anger": _ANGRY, "angry": _ANGRY, "mad": _ANGRY, "frustrated": _ANGRY,
}


def emotion_instruction(message: dict[str, Any]) -> str | None:
    """The instruction for the first emotion of `message` that CosyVoice2 knows, if any."""
    generation, voice = message.get("generation_config"), message.get("voice")
    names: list[Any] = [generation.get("emotion")] if isinstance(generation, dict) else []
    controls = voice.get("__experimental_controls") if isinstance(voice, dict) else None
    if isinstance(controls, dict) and isinstance(controls.get("emotion"), list):
        names += controls["emotion"]
    for name in names:
        if isinstance(name, str) and name.split(":")[0].strip().lower() in EMOTION_INSTRUCTIONS:
            return EMOTION_INSTRUCTIONS[name.split(":")[0].strip().lower()]
    return None


def voice_of(message: dict[str, Any], context_id: str | None = None) -> str:
    """The voice id of a request's `voice: {"mode": "id", "id"}`."""
    voice = field_of(message, "voice", dict, {})
    voice_id = voice.get("id", "default")
    if voice.get("mode", "id") != "id" or not isinstance(voice_id, str):
        raise ProtocolError("invalid_message", "voice must be {'mode': 'id', 'id': <voice id>}", context_id)
    return voice_id


def output_format_of(message: dict[str, Any], context_id: str | None = None) -> tuple[str, Encoding, int]:
    """(container, encoding, sample_rate) of a request's `output_format`."""
    output = field_of(message, "output_format", dict, {})
    container = output.get("container", "raw")
    if container not in CONTAINERS:
        raise ProtocolError(
            "unsupported_encoding",
            f"container {container!r} is not supported; use one of {', '.join(CONTAINERS)}",
            context_id,
        )
    encoding = _ENCODINGS.get(output.get("encoding", "pcm_s16le"))
    if encoding is None and container != "mp3":
        raise ProtocolError(
            "unsupported_encoding",
            f"encoding {output.get('encoding')!r} is not supported; use one of {', '.join(_ENCODINGS)}",
            context_id,
        )
    rate = output.get("sample_rate", 24000)
    if isinstance(rate, bool) or not isinstance(rate, int):
        raise ProtocolError("invalid_message", "output_format.sample_rate must be an integer", context_id)
    if rate not in SUPPORTED_RATES:
        raise ProtocolError(
            "unsupported_sample_rate",
            f"sample_rate {rate} is not supported; use one of {', '.join(map(str, SUPPORTED_RATES))}",
            context_id,
        )
    return container, encoding or Encoding.PCM_S16LE, rate


def speed_of(message: dict[str, Any], context_id: str | None = None) -> float:
    """The speech speed: `generation_config.speed` (a multiplier), or the older top-level `speed` (a
    number in [-1, 1] around normal, or a word)."""
    config = field_of(message, "generation_config", dict, {})
    speed = config.get("speed")
    if speed is not None:
        numeric = isinstance(speed, int | float) and not isinstance(speed, bool)
        if not numeric or not MIN_SPEED <= speed <= MAX_SPEED:
            raise ProtocolError(
                "invalid_speed",
                f"generation_config.speed must be a number between {MIN_SPEED} and {MAX_SPEED:g}",
                context_id,
            )
        return float(speed)
    legacy = field_of(message, "speed", (str, int, float))
    if legacy is None:
        return 1.0
    if isinstance(legacy, str):
        if legacy not in _SPEED_WORDS:
            raise ProtocolError(
                "invalid_speed", f"speed must be a number or one of {', '.join(_SPEED_WORDS)}", context_id
            )
        return _SPEED_WORDS[legacy]
    if not -1.0 <= legacy <= 1.0:
        raise ProtocolError("invalid_speed", "speed must be between -1 and 1", context_id)
    # -1 (slowest) .. 0 (normal) .. 1 (fastest), as a tempo multiplier 0.5 .. 1 .. 2.
    return float(2.0**legacy)


@dataclass
class _ContextState:
    """What the dialect remembers of one open context."""

    timestamps: bool  # add_timestamps
    audio_flush_id: int = 1  # the flush_id of the audio sent now (flushes done + 1)


class CartesiaDialect:
    """Cartesia's message shapes over the core; remembers per context whether it asked for timestamps
    and the flush_id of the audio it is sending."""

    def __init__(self) -> None:
        self._contexts: dict[str, _ContextState] = {}

    def decode(self, frame: str | bytes, protocol: AgentProtocol) -> list[Command]:
        message = parse_json_object(frame)
        context_id = field_of(message, "context_id", str, required=True)
        if field_of(message, "cancel", bool, False):
            return [CancelContext(context_id)]
        commands: list[Command] = []
        if not protocol.has_context(context_id):
            commands.append(self._start(message, context_id))
            # A context the core no longer holds sends no more audio or flush_done: forget it.
            self._contexts = {cid: s for cid, s in self._contexts.items() if protocol.has_context(cid)}
            self._contexts[context_id] = _ContextState(field_of(message, "add_timestamps", bool, False))
        transcript = field_of(message, "transcript", str, "")
        if transcript:
            commands.append(AppendText(context_id, transcript))
        if field_of(message, "flush", bool, False):
            commands.append(Flush(context_id, report=True))
        if not field_of(message, "continue", bool, False):
            commands.append(EndContext(context_id))
        return commands

    def _start(self, message: dict[str, Any], context_id: str) -> StartContext:
        container, encoding, rate = output_format_of(message, context_id)
        if container != "raw":
            raise ProtocolError(
                "unsupported_encoding", "the websocket sends the 'raw' container only", context_id
            )
        style = style_fields({"language": message.get("language"), "context_id": context_id}, context_id)
        return StartContext(
            context_id,
            voice=voice_of(message, context_id),
            sample_rate=rate,
            encoding=encoding,
            speed=speed_of(message, context_id),
            streaming=streaming_hints(
                context_id, max_buffer_delay_ms=field_of(message, "max_buffer_delay_ms", int)
            ),
            language=style["language"],
            instructions=emotion_instruction(message),
        )

    def encode(self, event: Event) -> list[str | bytes]:
        if isinstance(event, AudioOut):
            state = self._contexts.get(event.context_id)
            flush_id = state.audio_flush_id if state else 1
            frames: list[str | bytes] = []
            if event.words and state and state.timestamps:
                frames.append(
                    json.dumps(
                        {
                            "type": "timestamps",
                            "done": False,
                            "status_code": 206,
                            "context_id": event.context_id,
                            "flush_id": flush_id,
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
                        "flush_id": flush_id,
                    }
                )
            )
            return frames
        if isinstance(event, FlushDone):
            state = self._contexts.get(event.context_id)
            if state:
                state.audio_flush_id = event.flush_id + 1
            message = {
                "type": "flush_done",
                "done": False,
                "flush_done": True,
                "flush_id": event.flush_id,
                "status_code": 206,
                "context_id": event.context_id,
            }
            return [json.dumps(message)]
        if isinstance(event, ContextDone):
            if event.cancelled:
                return []
            return [
                json.dumps({"type": "done", "done": True, "status_code": 206, "context_id": event.context_id})
            ]
        return [
            json.dumps(
                {
                    "type": "error",
                    "done": True,
                    "status_code": _STATUS_FOR_CODE.get(event.code, 400),
                    "error": event.message,
                    "error_code": event.code,
                    "title": event.code.replace("_", " "),
                    "message": event.message,
                    "context_id": event.context_id,
                }
            )
        ]
