"""Every limit answers with its coded error over real loopback sockets, and the service carries on.

Servers of their own with small limits: timeouts of a fraction of a second, two queued texts per
context, two voices per client, a 1 MiB upload limit. No test asserts a duration: a test waits for the
server's own answer (an error, a close) with a generous ceiling.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import pytest_asyncio
import soundfile
from testing import LOOPBACK, LiveServer, serve, service_config
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from engines.build.synthetic import voiced_clip
from realtime.config import LimitsConfig, WebRTCConfig
from realtime.limits import RateLimiter, Slots

pytestmark = pytest.mark.asyncio(loop_scope="session")

CEILING_S = 30.0
UPLOAD_LIMIT = 1 << 20
FIXED = 10


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tight(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LiveServer]:
    limits = LimitsConfig(
        header_timeout_s=0.5,
        body_timeout_s=0.5,
        ws_idle_timeout_s=2.0,
        context_idle_timeout_s=0.5,
        queued_sentences=2,
        voices_per_client=2,
        pending_offers_per_client=2,
    )
    config = service_config(
        tiny_models,
        tmp_path_factory.mktemp("voices"),
        limits=limits,
        max_voice_upload_bytes=UPLOAD_LIMIT,
        webrtc=WebRTCConfig(max_sessions=8, host_addresses=(LOOPBACK,)),
    )
    async with serve(config) as server:
        yield server


def wav_bytes(seconds: float, rate: int = 16000, seed: int = 4) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, voiced_clip(seconds, rate, seed=seed), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


async def upload(
    http: httpx.AsyncClient, voice_id: str, audio: bytes, name: str = "clip.wav"
) -> httpx.Response:
    return await http.post(
        "/v1/voices",
        data={"voice_id": voice_id, "transcript": "A short clip."},
        files={"audio": (name, audio, "application/octet-stream")},
    )


async def json_until(ws: ClientConnection, done: object) -> list[dict]:
    received = []
    async with asyncio.timeout(CEILING_S):
        while True:
            frame = await ws.recv()
            if isinstance(frame, bytes):
                continue
            message = json.loads(frame)
            received.append(message)
            if done(message):  # type: ignore[operator]
                return received


# -- pure policy -----------------------------------------------------------------------------------------


async def test_rate_limiter_refills_and_forgets() -> None:
    limiter = RateLimiter(rate=2.0, burst=3)
    assert [limiter.acquire("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("a", 0.0) == pytest.approx(0.5)
    assert limiter.acquire("b", 0.0) == 0.0  # another client has its own bucket
    assert limiter.acquire("a", 0.5) == 0.0  # one token refilled
    slots = Slots(2)
    assert slots.try_acquire("a") and slots.try_acquire("a") and not slots.try_acquire("a")
    slots.release("a")
    slots.release("a")
    assert len(slots) == 0


# -- HTTP timeouts ---------------------------------------------------------------------------------------


async def test_incomplete_headers_are_cut_off(tight: LiveServer) -> None:
    reader, writer = await asyncio.open_connection(LOOPBACK, tight.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finished
    async with asyncio.timeout(CEILING_S):
        assert await reader.read() == b""
    writer.close()


async def test_a_stalled_body_gets_408(tight: LiveServer) -> None:
    reader, writer = await asyncio.open_connection(LOOPBACK, tight.port)
    writer.write(
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    async with asyncio.timeout(CEILING_S):
        status = await reader.readline()
        rest = await reader.read(4096)
    writer.close()
    assert status.startswith(b"HTTP/1.1 408")
    assert b'"body_timeout"' in rest


async def test_a_chunked_upload_is_refused_once_it_passes_the_limit(tight: LiveServer) -> None:
    """The server answers while the client is still sending: nothing past the limit is spooled."""
    reader, writer = await asyncio.open_connection(LOOPBACK, tight.port)
    writer.write(
        b"POST /v1/voices HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: multipart/form-data; boundary=xyz\r\n\r\n"
    )
    answer = asyncio.create_task(reader.readline())
    piece = b"0" * 65536
    sent = 0
    ceiling = 200 * UPLOAD_LIMIT
    try:
        while not answer.done() and sent < ceiling:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            sent += len(piece)
            await asyncio.sleep(0)
    except ConnectionError:
        pass
    async with asyncio.timeout(CEILING_S):
        status = await answer
        rest = await reader.read(65536)
    writer.close()
    assert status.startswith(b"HTTP/1.1 400"), status
    assert b"upload_too_large" in rest
    assert sent < ceiling


# -- websocket idle and queue limits ---------------------------------------------------------------


async def test_an_idle_socket_is_closed_with_a_reason(tight: LiveServer) -> None:
    async with connect(f"{tight.ws_url}/v1/ws") as ws:
        (error,) = await json_until(ws, lambda m: m["type"] == "error")
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
    assert error["code"] == "idle_timeout" and error["context_id"] is None
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


async def test_a_context_holding_text_times_out_and_the_socket_lives(tight: LiveServer) -> None:
    async with connect(f"{tight.ws_url}/v1/ws") as ws:
        await ws.send(json.dumps({"type": "start", "context_id": "held", "fixed_length": FIXED}))
        await ws.send(json.dumps({"type": "text", "context_id": "held", "text": "no punctuation yet"}))
        (error,) = await json_until(ws, lambda m: m["type"] == "error")
        assert (error["code"], error["context_id"]) == ("context_timeout", "held")
        # The same socket goes on speaking.
        await ws.send(json.dumps({"type": "start", "context_id": "next", "fixed_length": FIXED}))
        await ws.send(json.dumps({"type": "text", "context_id": "next", "text": "Hello."}))
        await ws.send(json.dumps({"type": "end", "context_id": "next"}))
        received = await json_until(ws, lambda m: m["type"] in ("done", "error"))
    assert received[-1] == {"type": "done", "context_id": "next", "cancelled": False}


async def test_more_queued_texts_than_the_cap_get_queue_full_on_that_context(tight: LiveServer) -> None:
    async with connect(f"{tight.ws_url}/v1/ws") as ws:
        await ws.send(json.dumps({"type": "start", "context_id": "q", "fixed_length": 50}))
        for n in range(12):
            await ws.send(json.dumps({"type": "text", "context_id": "q", "text": f"Sentence {n}. "}))
        await ws.send(json.dumps({"type": "end", "context_id": "q"}))
        received = await json_until(ws, lambda m: m["type"] == "done")
    errors = [m for m in received if m["type"] == "error"]
    assert errors and {(e["code"], e["context_id"]) for e in errors} == {("queue_full", "q")}
    assert received[-1] == {"type": "done", "context_id": "q", "cancelled": False}


# -- voices ----------------------------------------------------------------------------------------------


async def test_voice_count_quota_per_client(tight: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=tight.http_url, timeout=60) as http:
        for n in range(2):
            assert (await upload(http, f"quota{n}", wav_bytes(1.5, seed=n))).status_code == 201
        third = await upload(http, "quota2", wav_bytes(1.5))
        assert third.status_code == 403 and third.json()["error"]["code"] == "voice_quota_exceeded"
        for n in range(2):
            assert (await http.delete(f"/v1/voices/quota{n}")).status_code == 204
        assert (await upload(http, "quota2", wav_bytes(1.5))).status_code == 201
        assert (await http.delete("/v1/voices/quota2")).status_code == 204


async def test_two_racing_uploads_of_one_id_leave_one_usable_voice(tight: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=tight.http_url, timeout=60) as http:
        first, second = await asyncio.gather(
            upload(http, "racer", wav_bytes(2.0, seed=1)), upload(http, "racer", wav_bytes(2.0, seed=2))
        )
        assert sorted([first.status_code, second.status_code]) == [201, 409]
        loser = first if first.status_code == 409 else second
        assert loser.json()["error"]["code"] == "voice_exists"
        listed = [v["voice_id"] for v in (await http.get("/v1/voices")).json()["data"]]
        assert listed.count("racer") == 1
        speech = {"voice": "racer", "input": "Hi.", "response_format": "pcm", "fixed_length": FIXED}
        spoken = await http.post("/v1/audio/speech", json=speech)
        assert spoken.status_code == 200 and len(spoken.content) == FIXED * 960 * 2
        assert (await http.delete("/v1/voices/racer")).status_code == 204
    assert sorted(p.name for p in tight.config.voice_store.iterdir()) == []


async def test_absurd_sample_rates_are_refused(tight: LiveServer) -> None:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.linspace(-0.5, 0.5, 20, dtype=np.float32), 1, format="WAV", subtype="PCM_16")
    async with httpx.AsyncClient(base_url=tight.http_url, timeout=60) as http:
        response = await upload(http, "one-hertz", buffer.getvalue())
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_sample_rate"
    assert "sample rate 1 Hz" in response.json()["error"]["message"]


@contextmanager
def peak_rss_growth() -> Iterator[list[int]]:
    """Samples this process's resident set (the server runs in it) every 2 ms; yields [peak growth]."""
    page = 4096

    def rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * page

    baseline = rss()
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], rss() - baseline)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()


def hour_of_silence_flac() -> bytes:
    """~546 KB of FLAC that decodes to an hour of 48 kHz audio (691 MB of float32), written in blocks."""
    buffer = io.BytesIO()
    block = np.zeros(48000 * 10, dtype=np.int16)
    with soundfile.SoundFile(buffer, "w", 48000, 1, "PCM_16", format="FLAC") as flac:
        for _ in range(360):
            flac.write(block)
    return buffer.getvalue()


async def test_a_decompression_bomb_is_refused_with_bounded_memory(tight: LiveServer) -> None:
    bomb = await asyncio.to_thread(hour_of_silence_flac)
    assert len(bomb) < UPLOAD_LIMIT
    async with httpx.AsyncClient(base_url=tight.http_url, timeout=120) as http:
        with peak_rss_growth() as growth:
            response = await upload(http, "bomb", bomb, "silence.flac")
            assert (await http.get("/healthz")).status_code == 200
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "audio_too_long"
    # Decoding stops at the 30 s limit (~6 MB of samples); decoding it whole would take ~700 MB.
    assert growth[0] < 128 * 1024 * 1024, growth[0]


async def test_an_upload_does_not_hold_up_other_streams(tight: LiveServer) -> None:
    """A long clip is encoded off the event loop: a websocket utterance runs to its end meanwhile."""
    async with httpx.AsyncClient(base_url=tight.http_url, timeout=120) as http:
        uploading = asyncio.create_task(upload(http, "long", wav_bytes(20.0)))
        async with connect(f"{tight.ws_url}/v1/ws") as ws:
            await ws.send(json.dumps({"type": "start", "context_id": "c", "fixed_length": FIXED}))
            await ws.send(json.dumps({"type": "text", "context_id": "c", "text": "Meanwhile."}))
            await ws.send(json.dumps({"type": "end", "context_id": "c"}))
            received = await json_until(ws, lambda m: m["type"] in ("done", "error"))
        assert received[-1]["type"] == "done"
        assert (await uploading).status_code == 201
        assert (await http.delete("/v1/voices/long")).status_code == 204


# -- per-client rate and connection limits ---------------------------------------------------------------


async def test_request_rate_per_client(tiny_models: Path, tmp_path: Path) -> None:
    limits = LimitsConfig(requests_per_s=0.01, request_burst=3)
    async with (
        serve(service_config(tiny_models, tmp_path, limits=limits)) as server,
        httpx.AsyncClient(base_url=f"http://{LOOPBACK}:{server.port}") as http,
    ):
        answers = [await http.get("/v1/voices") for _ in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        assert answers[-1].json()["error"]["code"] == "rate_limited"
        assert int(answers[-1].headers["retry-after"]) >= 1
        with pytest.raises(InvalidStatus) as caught:
            async with connect(f"{server.ws_url}/v1/ws"):
                pass
        assert caught.value.response.status_code == 429
        assert (await http.get("/healthz")).status_code == 200  # never limited


async def test_concurrent_connections_per_client(tiny_models: Path, tmp_path: Path) -> None:
    limits = LimitsConfig(connections_per_client=2)
    async with serve(service_config(tiny_models, tmp_path, limits=limits)) as server:
        url = f"{server.ws_url}/v1/ws"
        async with connect(url), connect(url) as second:
            with pytest.raises(InvalidStatus) as caught:
                async with connect(url):
                    pass
            response = caught.value.response
            assert response.status_code == 429
            assert json.loads(response.body)["code"] == "too_many_connections"
            await second.close()
            # Once the server has seen the socket go, its slot is free again.
            async with asyncio.timeout(CEILING_S):
                while True:
                    try:
                        async with connect(url) as third:
                            await third.ping()
                        break
                    except InvalidStatus:
                        await asyncio.sleep(0.05)


async def test_every_limit_has_a_serve_flag() -> None:
    from realtime.cli import _config, build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--models",
            "/nonexistent",
            "--api-key",
            "flag-key-1234",
            "--cors-origin",
            "https://a.example",
            "--rate-limit",
            "5",
            "--rate-burst",
            "7",
            "--max-connections-per-client",
            "9",
            "--header-timeout",
            "2",
            "--body-timeout",
            "3",
            "--ws-idle-timeout",
            "4",
            "--context-idle-timeout",
            "5",
            "--max-queued-sentences",
            "6",
            "--max-pending-offers",
            "1",
            "--max-voices-per-client",
            "2",
            "--max-voice-bytes-per-client",
            "1000",
            "--max-voices",
            "3",
            "--max-voice-bytes",
            "2000",
            "--max-text-chars",
            "100",
            "--max-contexts-per-socket",
            "2",
            "--max-voice-upload-seconds",
            "10",
            "--max-voice-upload-bytes",
            "4096",
            "--webrtc-connect-timeout",
            "6",
        ]
    )
    config = _config(args)
    assert config.access.api_keys == ("flag-key-1234",) and config.access.cors_origins == (
        "https://a.example",
    )
    assert config.limits == LimitsConfig(5.0, 7, 9, 2.0, 3.0, 4.0, 5.0, 6, 1, 2, 1000, 3, 2000)
    assert (config.max_text_chars, config.max_contexts_per_socket) == (100, 2)
    assert (config.max_voice_upload_s, config.max_voice_upload_bytes) == (10.0, 4096)
    assert config.webrtc.connect_timeout_s == 6.0
