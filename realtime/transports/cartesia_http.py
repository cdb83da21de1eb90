"""Cartesia's HTTP TTS routes: `POST /cartesia/tts/bytes` (the audio file, streamed) and
`POST /cartesia/tts/sse` (server-sent events with base64 chunks, word timestamps and `done`).

The body is Cartesia's generation request (`model_id`, `transcript`, `voice`, `output_format`,
`generation_config`, `language`; the SSE route also `add_timestamps` and `context_id`), parsed by the
Cartesia dialect (`realtime/protocol/cartesia.py`). Containers: `raw` (any encoding and supported
rate), `wav` (16-bit PCM at the requested rate, whatever `encoding` says), `mp3` (at 24 kHz; its frames
carry the rate); the SSE route sends `raw` only. Errors before audio starts are JSON
`{"error_code", "title", "message"}` with an HTTP status; after, the SSE stream ends with an `error`
event and a bytes body ends early.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from realtime import validation
from realtime.audio import CodecStreamEncoder, Encoding, Resampler, encode_samples, wav_header
from realtime.protocol.cartesia import emotion_instruction, output_format_of, speed_of, voice_of
from realtime.protocol.core import ProtocolError, field_of
from realtime.runtime import Runtime
from realtime.session import AudioChunk, ServiceError, Session, SpeechRequest
from realtime.transports.body import BodyTooLarge, read_body
from realtime.transports.first_audio import chunks_from, first_chunk
from realtime.validation import InvalidInput

logger = logging.getLogger(__name__)

MAX_JSON_BYTES = 256 * 1024
_RAW_CONTENT_TYPES = {
    Encoding.PCM_S16LE: "audio/pcm", Encoding.PCM_F32LE: "audio/pcm", Encoding.MULAW: "audio/basic",
    Encoding.ALAW: "audio/pcma",
}


@dataclass(frozen=True)
class CartesiaSpeech:
    """A validated Cartesia HTTP generation request."""

    request: SpeechRequest
    container: str
    encoding: Encoding
    sample_rate: int
    add_timestamps: bool
    context_id: str | None


def parse_body(body: Any) -> CartesiaSpeech:
    if not isinstance(body, dict):
        raise ProtocolError("invalid_message", "the body must be a JSON object")
    transcript = field_of(body, "transcript", str, required=True)
    container, encoding, rate = output_format_of(body)
    try:
        language = body.get("language")
        request = SpeechRequest(text=transcript, voice=voice_of(body), speed=speed_of(body),
                                language=language if isinstance(language, str) else None,
                                instructions=emotion_instruction(body))
    except ServiceError as exc:
        raise ProtocolError(exc.code, exc.message) from None
    return CartesiaSpeech(
        request,
        container,
        encoding,
        rate,
        add_timestamps=field_of(body, "add_timestamps", bool, False),
        context_id=field_of(body, "context_id", str),
    )


def _error(code: str, message: str, status: int, retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    body = {"error_code": code, "title": code.replace("_", " "), "message": message}
    return JSONResponse(body, status_code=status, headers=headers)


class _RawAudio:
    """24 kHz chunks → the requested rate and encoding (the resampler's tail on the final chunk)."""

    def __init__(self, rate: int, encoding: Encoding) -> None:
        self._resampler = Resampler(rate)
        self._encoding = encoding

    def convert(self, chunk: AudioChunk) -> bytes:
        pcm = self._resampler.process(chunk.pcm)
        if chunk.final:
            pcm = np.concatenate([pcm, self._resampler.flush()])
        return encode_samples(pcm, self._encoding)


async def _file_bytes(session: Session, chunks: AsyncIterator[AudioChunk],
                      speech: CartesiaSpeech) -> AsyncIterator[bytes]:
    try:
        if speech.container == "mp3":
            encoder = CodecStreamEncoder("mp3")
            async for chunk in chunks:
                data = await asyncio.to_thread(encoder.encode, chunk.pcm)
                if data:
                    yield data
            yield await asyncio.to_thread(encoder.finish)
            return
        wav = speech.container == "wav"
        raw = _RawAudio(speech.sample_rate, Encoding.PCM_S16LE if wav else speech.encoding)
        if wav:
            yield wav_header(speech.sample_rate)
        async for chunk in chunks:
            yield raw.convert(chunk)
    except ServiceError as exc:
        # Headers are gone: end the body early; the client sees a truncated file.
        logger.warning("[%s] cartesia bytes ended early: %s", session.session_id, exc.code)
    finally:
        await session.aclose()


async def _events(session: Session, speech: CartesiaSpeech) -> AsyncIterator[bytes]:
    def event(kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "context_id": speech.context_id}
        return f"data: {json.dumps(payload)}\n\n".encode()

    raw = _RawAudio(speech.sample_rate, speech.encoding)
    try:
        async for chunk in session:
            if speech.add_timestamps and chunk.words:
                timestamps = {
                    "words": [w.word for w in chunk.words],
                    "start": [round(w.start_s, 3) for w in chunk.words],
                    "end": [round(w.end_s, 3) for w in chunk.words],
                }
                yield event("timestamps", done=False, status_code=206, word_timestamps=timestamps)
            data = base64.b64encode(raw.convert(chunk)).decode("ascii")
            step_ms = round(chunk.duration_s * 1000, 1)
            yield event("chunk", data=data, done=False, status_code=206, step_time=step_ms)
        yield event("done", done=True, status_code=200)
    except ServiceError as exc:
        yield event(
            "error", done=True, status_code=exc.http_status, error_code=exc.code,
            title=exc.code.replace("_", " "), message=exc.message, request_id=session.session_id,
        )
    finally:
        await session.aclose()


def routes(runtime: Runtime) -> list[BaseRoute]:
    async def start(request: Request, sse: bool) -> tuple[Session, CartesiaSpeech] | Response:
        try:
            raw = await read_body(request, MAX_JSON_BYTES)
            try:
                body = validation.parse_json(raw)
            except InvalidInput as exc:
                raise ProtocolError(exc.code, exc.message) from None
            speech = parse_body(body)
            if sse and speech.container != "raw":
                message = "server-sent events carry the 'raw' container only"
                raise ProtocolError("unsupported_encoding", message)
            return await runtime.open_session(speech.request), speech
        except (ProtocolError, BodyTooLarge) as exc:
            runtime.metrics.error(exc.code)
            return _error(exc.code, exc.message, 413 if isinstance(exc, BodyTooLarge) else 400)
        except ServiceError as exc:
            status = 404 if exc.code == "voice_not_found" else exc.http_status
            return _error(exc.code, exc.message, status, exc.retry_after_s)

    async def tts_bytes(request: Request) -> Response:
        started = await start(request, sse=False)
        if isinstance(started, Response):
            return started
        session, speech = started
        # The status waits for the first audio, so an error before it keeps its code (the SSE route
        # reports errors in-band, as Cartesia's does).
        try:
            first = await first_chunk(session)
        except ServiceError as exc:
            return _error(exc.code, exc.message, exc.http_status, exc.retry_after_s)
        media_type = {"wav": "audio/wav", "mp3": "audio/mpeg"}.get(
            speech.container, _RAW_CONTENT_TYPES[speech.encoding]
        )
        return StreamingResponse(_file_bytes(session, chunks_from(first, session), speech),
                                 media_type=media_type)

    async def tts_sse(request: Request) -> Response:
        started = await start(request, sse=True)
        if isinstance(started, Response):
            return started
        session, speech = started
        return StreamingResponse(
            _events(session, speech), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    return [
        Route("/cartesia/tts/bytes", tts_bytes, methods=["POST"]),
        Route("/cartesia/tts/sse", tts_sse, methods=["POST"]),
    ]
