"""ElevenLabs' HTTP text-to-speech routes, so the vendor's SDK and the frameworks' HTTP paths work by URL.

- `POST /v1/text-to-speech/{voice_id}` and `.../stream`: the audio in `output_format` (query parameter,
  default `mp3_44100_128`; the formats of `realtime.protocol.elevenlabs.parse_output_format`),
  streamed as it is synthesised.
- `POST /v1/text-to-speech/{voice_id}/with-timestamps`: one JSON object `{"audio_base64",
  "alignment": {"characters", "character_start_times_seconds", "character_end_times_seconds"},
  "normalized_alignment": (the same)}`.
- `POST /v1/text-to-speech/{voice_id}/stream/with-timestamps`: one such object per line as audio is
  synthesised, each with the characters of the words starting in its chunk (a space before every word
  but the first), times in seconds from the start of the utterance.

Body: `text` (required); `voice_settings.speed`, `seed` and `language_code` (cross-lingual synthesis
when it differs from the voice's language) are used; `model_id`, the other voice settings,
`previous_text`/`next_text`, pronunciation dictionaries and normalisation switches are accepted and
ignored. Errors: `{"detail": {"status": code, "message": sentence}}` with the
HTTP status of the problem (400 bad body or format, 404 unknown voice, 413, 429 busy).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from engines.llm.base import SamplingParams
from realtime import validation
from realtime.audio import RAW_ENCODINGS, Resampler, StreamEncoder, chunk_encoder
from realtime.protocol.core import ProtocolError
from realtime.protocol.elevenlabs import DEFAULT_OUTPUT_FORMAT, OutputFormat, parse_output_format
from realtime.runtime import Runtime
from realtime.session import AudioChunk, ServiceError, Session, SpeechRequest, WordTiming
from realtime.transports.body import BodyTooLarge, read_body
from realtime.transports.first_audio import chunks_from, first_chunk
from realtime.validation import InvalidInput

MAX_JSON_BYTES = 256 * 1024


def _error(code: str, message: str, status: int, retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse({"detail": {"status": code, "message": message}}, status_code=status, headers=headers)


def parse_body(body: Any, voice_id: str) -> SpeechRequest:
    """The `SpeechRequest` of an ElevenLabs text-to-speech body; ServiceError naming the bad field."""
    if not isinstance(body, dict):
        raise ServiceError("invalid_json", "the body must be a JSON object")
    text = body.get("text")
    if not isinstance(text, str) or not validation.is_valid_text(text):
        raise ServiceError("invalid_text", "'text' must be a string of valid Unicode")
    settings = body.get("voice_settings") or {}
    if not isinstance(settings, dict):
        raise ServiceError("invalid_voice_settings", "'voice_settings' must be an object")
    speed = settings.get("speed", 1.0)
    if speed is None:
        speed = 1.0
    try:
        speed = validation.speed(speed, "voice_settings.speed")
    except InvalidInput as exc:
        raise ServiceError("invalid_voice_settings", exc.message) from None
    try:
        seed = validation.seed(body.get("seed"))
    except InvalidInput as exc:
        raise ServiceError("invalid_seed", exc.message) from None
    language = body.get("language_code")
    if language is not None and not isinstance(language, str):
        raise ServiceError("invalid_language", "'language_code' must be a string")
    return SpeechRequest(text=text, voice=voice_id, sampling=SamplingParams(seed=seed), speed=speed,
                         language=language)


def char_alignment(words: list[WordTiming], first_word: bool) -> dict[str, list[Any]]:
    """ElevenLabs' HTTP alignment of `words` (absolute times): characters spread evenly over each word,
    a space spanning the pause before every word but the utterance's first."""
    chars: list[str] = []
    starts: list[float] = []
    ends: list[float] = []
    previous_end: float | None = None
    for index, word in enumerate(words):
        if index or not first_word:
            gap_start = word.start_s if previous_end is None else min(previous_end, word.start_s)
            chars.append(" ")
            starts.append(gap_start)
            ends.append(word.start_s)
        step = (word.end_s - word.start_s) / max(len(word.word), 1)
        for position, char in enumerate(word.word):
            chars.append(char)
            starts.append(word.start_s + position * step)
            ends.append(word.start_s + (position + 1) * step)
        previous_end = word.end_s
    return {
        "characters": chars,
        "character_start_times_seconds": [round(max(t, 0.0), 3) for t in starts],
        "character_end_times_seconds": [round(max(t, 0.0), 3) for t in ends],
    }


async def _encoded(
    session: Session, chunks: AsyncIterator[AudioChunk], output: OutputFormat
) -> AsyncIterator[tuple[bytes, AudioChunk]]:
    """Each chunk's audio in `output`, and the chunk; closes the session at the end."""
    resampler = Resampler(output.sample_rate)
    encoder = chunk_encoder(output.encoding, output.sample_rate, output.bit_rate)
    try:
        async for chunk in chunks:
            pcm = resampler.process(chunk.pcm)
            if chunk.final:
                pcm = np.concatenate([pcm, resampler.flush()])
            if output.encoding in RAW_ENCODINGS:
                data = encoder.encode(pcm)
            else:
                data = await asyncio.to_thread(_encode, encoder, pcm, chunk.final)
            yield data, chunk
    finally:
        await session.aclose()


def _encode(encoder: StreamEncoder, pcm: np.ndarray, final: bool) -> bytes:
    return encoder.encode(pcm) + (encoder.finish() if final else b"")


async def _audio(session: Session, chunks: AsyncIterator[AudioChunk],
                 output: OutputFormat) -> AsyncIterator[bytes]:
    try:
        async for data, _ in _encoded(session, chunks, output):
            if data:
                yield data
    except ServiceError:
        return  # headers are gone: the client sees a short body


async def _timestamped_lines(session: Session, chunks: AsyncIterator[AudioChunk],
                             output: OutputFormat) -> AsyncIterator[bytes]:
    first = True
    try:
        async for data, chunk in _encoded(session, chunks, output):
            alignment = char_alignment(list(chunk.words), first) if chunk.words else None
            first = first and not chunk.words
            line = {
                "audio_base64": base64.b64encode(data).decode("ascii"),
                "alignment": alignment,
                "normalized_alignment": alignment,
            }
            yield (json.dumps(line) + "\n").encode()
    except ServiceError:
        return


def routes(runtime: Runtime) -> list[BaseRoute]:
    """The four ElevenLabs text-to-speech routes over `runtime`."""

    async def open_session(
        request: Request,
    ) -> tuple[Session, AsyncIterator[AudioChunk], OutputFormat] | Response:
        """The session and its chunks once the first has arrived, or the error response."""
        voice_id = request.path_params["voice_id"]
        try:
            output = parse_output_format(request.query_params.get("output_format", DEFAULT_OUTPUT_FORMAT))
            raw = await read_body(request, MAX_JSON_BYTES)
            try:
                body = validation.parse_json(raw)
            except InvalidInput as exc:
                raise ServiceError(exc.code, exc.message) from None
            session = await runtime.open_session(parse_body(body, voice_id))
            first = await first_chunk(session)
            return session, chunks_from(first, session), output
        except ProtocolError as exc:
            runtime.metrics.error(exc.code)
            return _error(exc.code, exc.message, 400)
        except BodyTooLarge as exc:
            runtime.metrics.error(exc.code)
            return _error(exc.code, exc.message, exc.http_status)
        except ServiceError as exc:
            status = 404 if exc.code == "voice_not_found" else exc.http_status
            return _error(exc.code, exc.message, status, exc.retry_after_s)

    async def audio(request: Request) -> Response:
        opened = await open_session(request)
        if isinstance(opened, Response):
            return opened
        session, chunks, output = opened
        return StreamingResponse(_audio(session, chunks, output), media_type=output.content_type)

    async def with_timestamps(request: Request) -> Response:
        opened = await open_session(request)
        if isinstance(opened, Response):
            return opened
        session, chunks, output = opened
        pieces: list[bytes] = []
        words: list[WordTiming] = []
        try:
            async for data, chunk in _encoded(session, chunks, output):
                pieces.append(data)
                words.extend(chunk.words)
        except ServiceError as exc:
            return _error(exc.code, exc.message, exc.http_status, exc.retry_after_s)
        alignment = char_alignment(words, True)
        audio_base64 = base64.b64encode(b"".join(pieces)).decode("ascii")
        body = {"audio_base64": audio_base64, "alignment": alignment, "normalized_alignment": alignment}
        return JSONResponse(body)

    async def stream_with_timestamps(request: Request) -> Response:
        opened = await open_session(request)
        if isinstance(opened, Response):
            return opened
        session, chunks, output = opened
        return StreamingResponse(_timestamped_lines(session, chunks, output),
                                 media_type="application/x-ndjson")

    base = "/v1/text-to-speech/{voice_id}"
    return [
        Route(base, audio, methods=["POST"]),
        Route(f"{base}/stream", audio, methods=["POST"]),
        Route(f"{base}/with-timestamps", with_timestamps, methods=["POST"]),
        Route(f"{base}/stream/with-timestamps", stream_with_timestamps, methods=["POST"]),
    ]
