"""LiveKit Agents' TTS plugins (cartesia.TTS stream/synthesize, openai.TTS) against the server."""

from __future__ import annotations

import pytest
from harness import ClientRunner, SlotsFreed
from testing import LiveServer

pytestmark = pytest.mark.asyncio(loop_scope="session")

TURN_WORDS = "Hello there, it is sunny today. Shall we walk to the park? It is a fine day to be outside."


async def test_cartesia_stream_speaks_llm_tokens_with_timed_transcripts(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed
) -> None:
    result = await run_client(
        "livekit", "livekit_tts.py", "--http-url", live_server.http_url, "--mode", "cartesia-stream",
        "--sample-rate", "16000",
    )
    assert result["errors"] == [], result["_stderr"][-3000:]
    assert result["sample_rates"] == [16000]
    assert result["audio_bytes"] / 2 / 16000 > 0.5
    # The plugin aligns the server's word timestamps with the text it sent: all of it, in order.
    assert "".join(result["words"]) == TURN_WORDS
    await slots_freed()


async def test_cartesia_stream_closed_mid_utterance_frees_the_slot(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed
) -> None:
    result = await run_client(
        "livekit", "livekit_tts.py", "--http-url", live_server.http_url, "--mode", "cartesia-stream",
        "--interrupt",
    )
    assert result["errors"] == [], result["_stderr"][-3000:]
    assert result["audio_bytes"] > 0
    await slots_freed()


@pytest.mark.parametrize(("mode", "rate"), [("cartesia-synthesize", 16000), ("openai", 24000)])
async def test_synthesize(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed, mode: str, rate: int
) -> None:
    result = await run_client(
        "livekit", "livekit_tts.py", "--http-url", live_server.http_url, "--mode", mode,
        "--sample-rate", str(rate),
    )
    assert result["errors"] == [], result["_stderr"][-3000:]
    assert result["sample_rates"] == [rate]  # openai.TTS decodes its default mp3 at 24 kHz
    assert result["audio_bytes"] / 2 / rate > 0.5
    await slots_freed()
