"""The OpenAI-compatible HTTP API end to end: the official `openai` client against the live tiny server."""

from __future__ import annotations

import base64
import io
import json
import wave

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile

from realtime.transports.http import MAX_JSON_BYTES

pytestmark = pytest.mark.asyncio(loop_scope="session")

SAMPLES_PER_TOKEN = 960
FIXED = 40  # speech tokens per segment: audio length is predictable


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """Samples (mono float) and rate of an encoded file, through libav."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        return np.concatenate(frames).astype(np.float32), stream.rate


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)


async def test_openai_client_streams_pcm_of_the_expected_length(live_server):
    async with client(live_server).audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="default",
        input="Hello there, streaming world.",
        response_format="pcm",
        extra_body={"fixed_length": FIXED, "seed": 3},
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        pieces = [piece async for piece in response.iter_bytes()]
    audio = np.frombuffer(b"".join(pieces), dtype="<i2")
    assert audio.size == FIXED * SAMPLES_PER_TOKEN
    assert np.abs(audio).max() > 0


@pytest.mark.parametrize("response_format", ["wav", "mp3", "opus", "flac"])
async def test_every_container_format_decodes(live_server, response_format):
    async with client(live_server).audio.speech.with_streaming_response.create(
        model="cosyvoice2",
        voice="default",
        input="One format at a time.",
        response_format=response_format,
        extra_body={"fixed_length": FIXED},
    ) as response:
        data = await response.read()
    samples, rate = decode(data)
    expected_s = FIXED * SAMPLES_PER_TOKEN / 24000
    # Lossy codecs pad with their encoder delay; the duration stays within a frame or two of the speech.
    assert abs(samples.size / rate - expected_s) < 0.1
    if response_format in ("wav", "flac"):
        assert samples.size == FIXED * SAMPLES_PER_TOKEN and rate == 24000


async def test_a_streamed_wav_says_its_length_is_unknown_and_reads_whole(live_server):
    """The documented header of a streamed WAV: the streaming convention's 0xFFFFFFFF sizes, with which
    soundfile (libsndfile) reads exactly the samples sent, and Python's `wave` (which trusts the
    header) reports 2^31 frames while reading the same samples."""
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        body = {"input": "A streamed file.", "response_format": "wav", "fixed_length": FIXED}
        data = (await http.post("/v1/audio/speech", json=body)).content
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000 and samples.size == FIXED * SAMPLES_PER_TOKEN
    with wave.open(io.BytesIO(data)) as reader:
        assert reader.getnframes() == 0xFFFFFFFF // 2
        assert len(reader.readframes(reader.getnframes())) == FIXED * SAMPLES_PER_TOKEN * 2


async def test_sse_stream_carries_base64_deltas_then_done(live_server):
    async with (
        httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http,
        http.stream(
            "POST",
            "/v1/audio/speech",
            json={
                "model": "gpt-4o-mini-tts",
                "voice": "default",
                "input": "Events please.",
                "response_format": "pcm",
                "stream_format": "sse",
                "fixed_length": FIXED,
            },
        ) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [
            json.loads(line[len("data: ") :])
            async for line in response.aiter_lines()
            if line.startswith("data: ")
        ]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["output_tokens"] == FIXED
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == FIXED * SAMPLES_PER_TOKEN * 2


async def test_long_text_is_spoken_as_segments_without_gaps(live_server):
    text = " ".join(
        f"This is sentence number {i} of a long text, spoken in several segments." for i in range(12)
    )
    async with client(live_server).audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="default",
        input=text,
        response_format="pcm",
        extra_body={"fixed_length": 20},
    ) as response:
        audio = np.frombuffer(await response.read(), dtype="<i2")
    assert audio.size % (20 * SAMPLES_PER_TOKEN) == 0 and audio.size >= 2 * 20 * SAMPLES_PER_TOKEN


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": "tts-1", "voice": "nobody", "input": "hi"}, 404, "voice", "voice_not_found"),
        ({"model": "tts-1", "input": "   "}, 400, "input", "empty_text"),
        ({"model": "tts-1", "input": "x" * 3000}, 400, "input", "text_too_long"),
        (
            {"model": "tts-1", "input": "hi", "response_format": "aac"},
            400,
            "response_format",
            "unsupported_format",
        ),
        ({"model": "whisper-1", "input": "hi"}, 400, "model", "model_not_found"),
        ({"model": "tts-1", "input": "hi", "speed": 9}, 400, "speed", "invalid_speed"),
        ({"model": "tts-1", "input": 5}, 400, "input", "invalid_type"),
    ],
)
async def test_bad_requests_get_openai_shaped_errors(live_server, body, status, param, code):
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        response = await http.post("/v1/audio/speech", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code and error["message"]


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        ('{"input": "hi", "speed": 1e400}', "body", "invalid_json"),
        ('{"input": "hi", "speed": NaN}', "body", "invalid_json"),
        ('{"input": "hi", "speed": ' + "9" * 400 + "}", "speed", "invalid_speed"),
        ('{"input": "hi", "seed": ' + "9" * 40 + "}", "seed", "out_of_range"),
        ('{"input": "hi", "seed": -1}', "seed", "out_of_range"),
        ('{"input": "hi", "fixed_length": 0}', "fixed_length", "out_of_range"),
        ('{"input": "hi", "fixed_length": 1000000000}', "fixed_length", "out_of_range"),
        ('{"input": "\\ud800 hi"}', "input", "invalid_text"),
        ('{"input": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "body", "invalid_json"),
        ('{"input": "hi", "x": ' + "[" * 40 + "]" * 40 + "}", "body", "invalid_json"),
        ('{"input": "hi", "x": ' + "1" * 5000 + "}", "body", "invalid_json"),
    ],
)
async def test_malformed_values_are_refused_before_any_audio(live_server, raw, param, code):
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        response = await http.post(
            "/v1/audio/speech", content=raw.encode(), headers={"content-type": "application/json"}
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code and error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("text", ["<|endofprompt|>", "<|endofprompt|> " * 20],
                         ids=["on_the_loop", "on_a_thread"])
async def test_an_error_after_admission_is_a_status_not_an_empty_200(live_server, text):
    """Text the front end refuses only once admitted still gets its status: the headers wait for the
    first audio. A short text is cut on the event loop, a longer one on a worker thread: the same answer."""
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        body = {"input": text, "response_format": "pcm"}
        response = await http.post("/v1/audio/speech", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "empty_text"


async def test_wrong_methods_get_405_in_openai_shape(live_server):
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        response = await http.get("/v1/audio/speech")
        unknown = await http.get("/v1/nothing/here")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    error = response.json()["error"]
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error"
    assert "POST" in error["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


async def test_malformed_json_body_is_refused(live_server):
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        response = await http.post(
            "/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


async def test_oversized_bodies_are_refused_whether_declared_or_streamed(live_server):
    too_large = b"x" * (MAX_JSON_BYTES + 1)

    async def without_length():
        yield too_large

    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        for content in (too_large, without_length()):
            response = await http.post("/v1/audio/speech", content=content)
            assert response.status_code == 413
            error = response.json()["error"]
            assert error["code"] == "body_too_large" and error["param"] == "body"


async def test_openai_client_raises_its_own_error_type(live_server):
    with pytest.raises(openai.NotFoundError) as info:
        await client(live_server).audio.speech.create(model="tts-1", voice="nobody", input="hi")
    assert info.value.body["code"] == "voice_not_found"


async def test_speed_shortens_the_audio(live_server):
    async with client(live_server).audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="default",
        input="Faster please.",
        response_format="pcm",
        speed=2.0,
        extra_body={"fixed_length": 50},
    ) as response:
        audio = np.frombuffer(await response.read(), dtype="<i2")
    assert audio.size == pytest.approx(50 * SAMPLES_PER_TOKEN / 2, rel=0.05)


async def test_client_disconnect_mid_stream_frees_engine_resources(live_server, eventually):
    runtime = live_server.runtime
    text = " ".join(f"Sentence {i} goes on for a little while." for i in range(20))
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        body = {"model": "tts-1", "input": text, "response_format": "pcm", "fixed_length": 60}
        async with http.stream("POST", "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            async for _ in response.aiter_bytes():
                break
            assert runtime.stats().active_streams == 1
    await eventually(lambda: runtime.stats().active_streams == 0)
    await eventually(lambda: runtime.stats().llm_active + runtime.stats().llm_waiting == 0)
    await eventually(lambda: runtime.stats().token2wav_streams == 0)
