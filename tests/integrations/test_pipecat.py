"""Pipecat's own TTS services (Cartesia websocket and HTTP, OpenAI) in a pipeline against the server."""

from __future__ import annotations

import pytest
from harness import ClientRunner, SlotsFreed
from testing import LiveServer

pytestmark = pytest.mark.asyncio(loop_scope="session")

TURN_WORDS = "Hello there, it is sunny today. Shall we walk to the park? It is a fine day to be outside."


async def test_cartesia_service_speaks_an_llm_turn_with_word_timestamps(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed
) -> None:
    result = await run_client(
        "pipecat", "pipecat_tts.py", "--http-url", live_server.http_url, "--mode", "cartesia",
        "--sample-rate", "16000",
    )
    assert result["errors"] == [], result["_stderr"][-3000:]
    assert result["sample_rates"] == [16000]
    assert result["audio_bytes"] / 2 / 16000 > 0.5
    # Pipecat turns the server's word timestamps into text frames: every word, none glued.
    assert " ".join(result["words"]) == TURN_WORDS
    await slots_freed()


async def test_cartesia_service_interruption_frees_the_slot(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed
) -> None:
    result = await run_client(
        "pipecat", "pipecat_tts.py", "--http-url", live_server.http_url, "--mode", "cartesia", "--interrupt"
    )
    assert result["errors"] == [], result["_stderr"][-3000:]
    assert result["audio_bytes"] > 0
    await slots_freed()


@pytest.mark.parametrize("mode", ["cartesia-http", "openai"])
async def test_http_services_speak_each_sentence(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed, mode: str
) -> None:
    result = await run_client("pipecat", "pipecat_tts.py", "--http-url", live_server.http_url, "--mode", mode)
    assert result["errors"] == [], result["_stderr"][-3000:]
    assert result["sample_rates"] == [24000]
    assert result["audio_bytes"] / 2 / 24000 > 0.5
    await slots_freed()
