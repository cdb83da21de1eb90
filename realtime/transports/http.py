"""The OpenAI-compatible HTTP API: `POST /v1/audio/speech` and the voice registry under `/v1/voices`.

`POST /v1/audio/speech` takes OpenAI's JSON body: `model` (`cosyvoice2`, or the aliases `tts-1`,
`tts-1-hd`, `gpt-4o-mini-tts`), `input`, `voice`, `response_format` (`pcm` = 24 kHz s16le, `wav`,
`opus`, `mp3`, `flac`; default `mp3`), `speed` (0.25–4), `stream_format` (`audio`, or `sse` for
`speech.audio.delta` events carrying base64 audio, then `speech.audio.done`) and `instructions` (a
style in words: speaks in CosyVoice2's instruct2 mode with the voice's timbre). Extensions: `language`
(ISO 639 code of `input`: cross-lingual when it differs from the voice's), `mode` (`zero_shot`,
`cross_lingual`, `instruct2`), `seed` (int) and `fixed_length` (speech tokens per segment, for
benchmarks). Audio is streamed as it is synthesised. OpenAI's voice names (`alloy`, `ash`, ...) speak
the voice `ServiceConfig.voice_aliases` names (by default `default`) unless a voice of that name exists.

Voices: `GET /v1/voices`; `POST /v1/voices` (multipart: `audio` file, `transcript`, `voice_id`,
optional `language`, else detected from the transcript);
`DELETE /v1/voices/{voice_id}`.

Every error has OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`; a busy server
answers 429 with `Retry-After`; a speech body over 256 KiB, 413 (`body_too_large`).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Message

from engines.llm.base import PromptMode, SamplingParams
from realtime import validation
from realtime.audio import StreamEncoder, make_stream_encoder
from realtime.runtime import Runtime
from realtime.session import AudioChunk, ServiceError, Session, SpeechRequest
from realtime.transports.body import BodyTooLarge, read_body
from realtime.transports.first_audio import chunks_from, first_chunk
from realtime.validation import InvalidInput
from realtime.voice_aliases import resolve_voice
from realtime.voices import check_voice_id

logger = logging.getLogger(__name__)

MODELS = ("cosyvoice2", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
RESPONSE_FORMATS = ("mp3", "opus", "wav", "pcm", "flac")
STREAM_FORMATS = ("audio", "sse")
MAX_JSON_BYTES = 256 * 1024
# Room for the multipart boundaries and the small fields around a voice upload's audio.
_MULTIPART_OVERHEAD = 64 * 1024
# Encoders that are cheap enough to run on the event loop.
_INLINE_FORMATS = ("pcm", "wav")


# The body field a service error is about.
_PARAM_OF_CODE = {
    "voice_not_found": "voice", "empty_text": "input", "text_too_long": "input",
    "instructions_too_long": "instructions", "empty_instructions": "instructions",
    "invalid_mode": "mode", "missing_instructions": "mode", "mode_not_supported": "mode",
}


def error_response(exc: ServiceError, param: str | None = None) -> JSONResponse:
    """OpenAI's error body for `exc`, with Retry-After when the client should come back."""
    kind = (
        "rate_limit_error"
        if exc.http_status == 429
        else "server_error"
        if exc.http_status >= 500
        else "invalid_request_error"
    )
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    body = {"error": {"message": exc.message, "type": kind, "param": param, "code": exc.code}}
    return JSONResponse(body, status_code=exc.http_status, headers=headers)


class _ParamError(ServiceError):
    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(code, message, 400)
        self.param = param


@dataclass(frozen=True)
class SpeechParams:
    """A validated `/v1/audio/speech` body."""

    request: SpeechRequest
    response_format: str
    stream_format: str


def parse_speech_body(body: Any) -> SpeechParams:
    """Validate OpenAI's speech body; raises `_ParamError` naming the bad field."""
    if not isinstance(body, dict):
        raise _ParamError("body", "the body must be a JSON object", "invalid_json")
    model = body.get("model", "cosyvoice2")
    if model not in MODELS:
        raise _ParamError(
            "model", f"unknown model {model!r}; use one of {', '.join(MODELS)}", "model_not_found"
        )
    try:
        text = validation.text(body.get("input"), "input")
    except InvalidInput as exc:
        raise _ParamError("input", exc.message, exc.code) from None
    voice = body.get("voice", "default")
    if not isinstance(voice, str):
        raise _ParamError("voice", "'voice' must be a string (a voice id)", "invalid_type")
    response_format = body.get("response_format", "mp3")
    if response_format not in RESPONSE_FORMATS:
        raise _ParamError(
            "response_format",
            f"unsupported response_format {response_format!r}; use one of {', '.join(RESPONSE_FORMATS)}",
            "unsupported_format",
        )
    stream_format = body.get("stream_format", "audio")
    if stream_format not in STREAM_FORMATS:
        raise _ParamError("stream_format", f"stream_format must be 'audio' or 'sse', got {stream_format!r}")
    try:
        speed = validation.speed(body.get("speed", 1.0))
        seed = validation.seed(body.get("seed"))
        sampling = SamplingParams(seed=seed, fixed_length=validation.fixed_length(body.get("fixed_length")))
        instructions, language, mode = body.get("instructions"), body.get("language"), body.get("mode")
        for name, value in (("instructions", instructions), ("language", language), ("mode", mode)):
            if value is not None:
                validation.text(value, name)
    except InvalidInput as exc:
        raise _ParamError(exc.field or "body", exc.message, exc.code) from None
    if mode is not None and mode not in set(PromptMode):
        raise _ParamError("mode", f"mode must be one of {', '.join(PromptMode)}", "invalid_mode")
    try:
        request = SpeechRequest(text=text, voice=voice, sampling=sampling, speed=speed,
                                instructions=instructions, language=language,
                                mode=PromptMode(mode) if mode is not None else None)
    except ServiceError as exc:
        raise _ParamError("language" if exc.code == "invalid_language" else "speed", exc.message,
                          exc.code) from exc
    return SpeechParams(request, response_format, stream_format)


async def _encode(encoder: StreamEncoder, inline: bool, pcm: Any) -> bytes:
    return encoder.encode(pcm) if inline else await asyncio.to_thread(encoder.encode, pcm)


async def _audio_bytes(
    session: Session, chunks: AsyncIterator[AudioChunk], encoder: StreamEncoder, inline: bool
) -> AsyncIterator[bytes]:
    """The encoded file, piece by piece as chunks are synthesised; closes the session at the end.
    `inline`: the encoder is cheap enough to run on the event loop."""
    try:
        async for chunk in chunks:
            data = await _encode(encoder, inline, chunk.pcm)
            if data:
                yield data
        tail = encoder.finish() if inline else await asyncio.to_thread(encoder.finish)
        if tail:
            yield tail
    finally:
        await session.aclose()


async def _speech_bytes(
    session: Session, chunks: AsyncIterator[AudioChunk], encoder: StreamEncoder, inline: bool
) -> AsyncIterator[bytes]:
    try:
        async for data in _audio_bytes(session, chunks, encoder, inline):
            yield data
    except ServiceError as exc:
        # Headers are gone: end the body early; the client sees a truncated file.
        logger.warning("[%s] speech stream ended early: %s", session.session_id, exc.code)


async def _speech_events(
    session: Session, chunks: AsyncIterator[AudioChunk], encoder: StreamEncoder, inline: bool
) -> AsyncIterator[bytes]:
    def event(payload: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    try:
        async for data in _audio_bytes(session, chunks, encoder, inline):
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
    except ServiceError as exc:
        yield event(
            {
                "type": "error",
                "error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code},
            }
        )
        return
    usage = session.usage
    yield event(
        {
            "type": "speech.audio.done",
            "usage": {
                "input_tokens": usage.text_tokens,
                "output_tokens": usage.speech_tokens,
                "total_tokens": usage.text_tokens + usage.speech_tokens,
            },
        }
    )


def routes(runtime: Runtime) -> list[BaseRoute]:
    """The HTTP API's routes over `runtime`."""

    async def speech(request: Request) -> Response:
        try:
            raw = await read_body(request, MAX_JSON_BYTES)
            try:
                body = validation.parse_json(raw)
            except InvalidInput as exc:
                raise _ParamError("body", exc.message, exc.code) from None
            params = parse_speech_body(body)
            voice = resolve_voice(
                params.request.voice, lambda name: name in runtime.voices, runtime.config.voice_aliases
            )
            session = await runtime.open_session(dataclasses.replace(params.request, voice=voice))
            # An error before the first audio (text the front end refuses, a length the engine
            # cannot hold) still gets its status code: the headers wait for the first chunk.
            first = await first_chunk(session)
        except _ParamError as exc:
            runtime.metrics.error(exc.code)
            return error_response(exc, exc.param)
        except BodyTooLarge as exc:
            runtime.metrics.error(exc.code)
            return error_response(exc, "body")
        except ServiceError as exc:
            return error_response(exc, _PARAM_OF_CODE.get(exc.code))
        encoder = make_stream_encoder(params.response_format)
        inline = params.response_format in _INLINE_FORMATS
        chunks = chunks_from(first, session)
        if params.stream_format == "sse":
            return StreamingResponse(
                _speech_events(session, chunks, encoder, inline),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return StreamingResponse(
            _speech_bytes(session, chunks, encoder, inline), media_type=encoder.content_type
        )

    async def list_voices(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_voice_json(v) for v in runtime.voices.list()]})

    async def add_voice(request: Request) -> Response:
        try:
            voice_id, audio, transcript, language = await _read_voice_upload(
                request, runtime.config.max_voice_upload_bytes
            )
            owner = principal_of(request)
            info = await runtime.add_voice(voice_id, audio, transcript, language, owner=owner)
        except _ParamError as exc:
            runtime.metrics.error(exc.code)
            return error_response(exc, exc.param)
        except ServiceError as exc:
            about_audio = "audio" if exc.http_status == 400 else None
            return error_response(exc, "language" if exc.code == "invalid_language" else about_audio)
        logger.info("voice %s added", info.voice_id)
        return JSONResponse(_voice_json(info), status_code=201)

    async def delete_voice(request: Request) -> Response:
        # Without API keys every client may delete any uploaded voice (there is no identity to own it).
        requester = None if runtime.config.access.open else principal_of(request)
        try:
            await runtime.remove_voice(request.path_params["voice_id"], requester)
        except ServiceError as exc:
            return error_response(exc, "voice_id")
        return Response(status_code=204)

    return [
        Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/voices", list_voices, methods=["GET"]),
        Route("/v1/voices", add_voice, methods=["POST"]),
        Route("/v1/voices/{voice_id}", delete_voice, methods=["DELETE"]),
    ]


def _voice_json(info: Any) -> dict[str, Any]:
    return {
        "object": "voice",
        "voice_id": info.voice_id,
        "prompt_seconds": round(info.prompt_seconds, 3),
        "builtin": info.builtin,
        "language": info.language,
    }


def principal_of(request: Request) -> str:
    """Who sent the request (an API key's id, or the client's IP without keys), set by the guard."""
    return str(getattr(request.state, "principal", "anonymous"))


async def _read_voice_upload(request: Request, max_bytes: int) -> tuple[str, bytes, str, str | None]:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise _ParamError(
            "body",
            "send multipart/form-data with 'audio', 'transcript' and 'voice_id'",
            "invalid_content_type",
        )
    # Read (at most the limit of) the body first: a chunked upload is refused as soon as it passes the
    # limit, instead of being spooled whole by the multipart parser.
    try:
        body = await read_body(request, max_bytes + _MULTIPART_OVERHEAD)
    except BodyTooLarge:
        message = f"the upload is larger than {max_bytes} bytes"
        raise _ParamError("audio", message, "upload_too_large") from None
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return {"type": "http.disconnect"}
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    async with Request(request.scope, replay).form(max_files=1, max_fields=8) as form:
        audio = form.get("audio")
        transcript = form.get("transcript")
        voice_id = form.get("voice_id")
        language = form.get("language")
        if language is not None and not isinstance(language, str):
            raise _ParamError("language", "'language' must be a string", "invalid_type")
        if not isinstance(audio, UploadFile):
            raise _ParamError("audio", "'audio' must be an uploaded file", "missing_audio")
        if not isinstance(transcript, str) or not transcript.strip():
            raise _ParamError(
                "transcript", "'transcript' (what the clip says) is required", "missing_transcript"
            )
        if not validation.is_valid_text(transcript):
            raise _ParamError("transcript", "'transcript' is not valid Unicode", "invalid_text")
        if not isinstance(voice_id, str):
            raise _ParamError("voice_id", "'voice_id' is required", "missing_voice_id")
        try:
            check_voice_id(voice_id)
        except ServiceError as exc:
            raise _ParamError("voice_id", exc.message, exc.code) from None
        data = await audio.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise _ParamError("audio", f"the audio file is larger than {max_bytes} bytes", "upload_too_large")
    return voice_id, data, transcript, language
