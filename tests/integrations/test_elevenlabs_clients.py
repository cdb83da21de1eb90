"""ElevenLabs' own clients against the ElevenLabs dialect: the official SDK, Pipecat's websocket and HTTP
services and LiveKit's plugin, each pointed at the server by its URL alone (clients/*.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import av
import pytest
import pytest_asyncio
from harness import ClientRunner, SlotsFreed
from testing import LiveServer

pytestmark = pytest.mark.asyncio(loop_scope="session")

TURN = "Hello there, it is sunny today. Shall we walk to the park? It is a fine day to be outside."
TURN_WORDS = TURN.split(" ")
TEXT = "Hello there. How are you today?"


def decoded(audio_b64: str) -> tuple[str, int, int]:
    """(codec, sample rate, samples) of a compressed file, decoded by libav."""
    with av.open(io.BytesIO(base64.b64decode(audio_b64))) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return stream.codec_context.name, stream.codec_context.sample_rate, samples


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def tls_front(
    live_server: LiveServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, Path]]:
    """A TLS front of the live server (its URL and certificate): the SDK's realtime websocket always
    speaks wss://, as it would to a deployment behind TLS. Bytes are relayed as they are."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    openssl = await asyncio.create_subprocess_exec(
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=127.0.0.1",
        "-addext",
        "subjectAltName=IP:127.0.0.1",
        "-keyout",
        str(key),
        "-out",
        str(cert),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert await openssl.wait() == 0
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", live_server.port)
        await asyncio.gather(relay(client_reader, server_writer), relay(server_reader, client_writer))

    front = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    port = front.sockets[0].getsockname()[1]
    try:
        yield f"https://127.0.0.1:{port}", cert
    finally:
        front.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(front.wait_closed(), 5)


async def test_sdk_convert_default_mp3_and_stream(live_server: LiveServer, run_client: ClientRunner) -> None:
    result = await run_client(
        "vendor-sdks", "elevenlabs_sdk.py", "--http-url", live_server.http_url, "--mode", "convert"
    )
    codec, rate, samples = decoded(result["audio_b64"])
    assert codec.startswith("mp3") and rate == 44100 and samples > rate // 2  # mp3_44100_128, the default
    result = await run_client(
        "vendor-sdks",
        "elevenlabs_sdk.py",
        "--http-url",
        live_server.http_url,
        "--mode",
        "stream",
        "--output-format",
        "mp3_22050_32",
    )
    codec, rate, samples = decoded(result["audio_b64"])
    assert codec.startswith("mp3") and rate == 22050 and samples > rate // 2


async def test_sdk_with_timestamps(live_server: LiveServer, run_client: ClientRunner) -> None:
    result = await run_client(
        "vendor-sdks",
        "elevenlabs_sdk.py",
        "--http-url",
        live_server.http_url,
        "--mode",
        "timestamps",
        "--output-format",
        "pcm_16000",
    )
    assert result["chars"] == TEXT and result["streamed_chars"] == TEXT
    starts, ends = result["starts"], result["ends"]
    assert starts == sorted(starts) and all(0 <= s <= e for s, e in zip(starts, ends, strict=True))
    audio_s = len(base64.b64decode(result["audio_b64"])) / 2 / 16000
    assert ends[-1] <= audio_s + 0.01 and result["streamed_audio_bytes"] > 0


@pytest.mark.parametrize("output_format", [None, "pcm_24000"])
async def test_sdk_convert_realtime(
    live_server: LiveServer,
    run_client: ClientRunner,
    tls_front: tuple[str, Path],
    slots_freed: SlotsFreed,
    output_format: str | None,
) -> None:
    url, cert = tls_front
    args = ["--http-url", live_server.http_url, "--https-url", url, "--ca", str(cert), "--mode", "realtime"]
    if output_format:
        args += ["--output-format", output_format]
    # Returns at all only because the server closes the socket after isFinal, as ElevenLabs does.
    result = await run_client("vendor-sdks", "elevenlabs_sdk.py", *args)
    audio = base64.b64decode(result["audio_b64"])
    if output_format is None:
        codec, rate, samples = decoded(result["audio_b64"])
        assert codec.startswith("mp3") and rate == 44100 and samples > rate
    else:
        assert len(audio) % 2 == 0 and len(audio) > 24000 * 2
    await slots_freed()


@pytest.mark.parametrize(
    "mode",
    [
        ["--mode", "websocket"],  # Pipecat's default: sentences, auto_mode
        ["--mode", "websocket", "--tokens"],  # TextAggregationMode.TOKEN: raw tokens, no auto_mode
        ["--mode", "http"],
    ],
    ids=["websocket", "websocket-tokens", "http"],
)
async def test_pipecat_service_speaks_a_token_paced_turn(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed, mode: list[str]
) -> None:
    result = await run_client(
        "pipecat", "pipecat_elevenlabs.py", "--http-url", live_server.http_url, "--sample-rate", "16000",
        *mode,
    )
    assert result["errors"] == []
    assert result["sample_rates"] == [16000] and result["audio_bytes"] > 16000 * 2
    # Pipecat's word timestamps, parsed from our alignment: every word, in order, none glued.
    assert result["words"] == TURN_WORDS
    await slots_freed()


async def test_pipecat_interruption_frees_the_slot(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed
) -> None:
    result = await run_client(
        "pipecat",
        "pipecat_elevenlabs.py",
        "--http-url",
        live_server.http_url,
        "--interrupt",
        "--sample-rate",
        "8000",
    )
    assert result["errors"] == [] and result["audio_bytes"] > 0 and result["sample_rates"] == [8000]
    await slots_freed()


async def test_livekit_stream_default_format_with_word_timings(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed
) -> None:
    result = await run_client("livekit", "livekit_elevenlabs.py", "--http-url", live_server.http_url)
    assert result["sample_rates"] == [22050] and result["samples"] > 22050  # mp3_22050_32, decoded by LiveKit
    # LiveKit's transcript is every aligned character in order: exactly the text, no space doubled.
    assert "".join(result["words"]) == TURN
    assert [w.strip() for w in result["words"]] == TURN_WORDS
    await slots_freed()


async def test_livekit_stream_interruption_and_synthesize(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed
) -> None:
    result = await run_client(
        "livekit",
        "livekit_elevenlabs.py",
        "--http-url",
        live_server.http_url,
        "--interrupt",
        "--encoding",
        "pcm_16000",
    )
    assert result["sample_rates"] == [16000] and result["samples"] > 0
    await slots_freed()
    result = await run_client(
        "livekit", "livekit_elevenlabs.py", "--http-url", live_server.http_url, "--mode", "synthesize"
    )
    assert result["sample_rates"] == [22050] and result["samples"] > 22050 // 2
    await slots_freed()
