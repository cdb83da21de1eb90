"""Cartesia's own clients against the Cartesia dialect: the SDK, Pipecat's services and LiveKit's plugin."""

from __future__ import annotations

from typing import Any

import pytest
from harness import ClientRunner, SlotsFreed
from testing import LiveServer

pytestmark = pytest.mark.asyncio(loop_scope="session")

def _seconds(result: dict[str, object], rate: int, bytes_per_sample: int = 2) -> float:
    audio_bytes = result["audio_bytes"]
    assert isinstance(audio_bytes, int)
    assert audio_bytes % bytes_per_sample == 0
    return audio_bytes / bytes_per_sample / rate


async def run_sdk(run_client: ClientRunner, server: LiveServer, *args: str) -> dict[str, Any]:
    """cartesia_sdk.py's result against `server` with `args`."""
    return await run_client("vendor-sdks", "cartesia_sdk.py", "--http-url", server.http_url, *args)


async def test_sdk_websocket_token_paced_with_timestamps(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed
) -> None:
    result = await run_sdk(run_client, live_server, "--sample-rate", "16000")
    assert "error" not in result, result
    assert _seconds(result, 16000) > 0.5
    assert result["types"] == ["chunk", "done", "timestamps"]
    # Every word the client streamed comes back timed, in order and without glued neighbours.
    assert " ".join(result["words"]) == (
        "Hello there, it is sunny today. Shall we walk to the park? It is a fine day to be outside."
    )
    assert result["starts"] == sorted(result["starts"])
    await slots_freed()


async def test_sdk_websocket_cancel_frees_the_slot(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed
) -> None:
    result = await run_sdk(run_client, live_server, "--interrupt")
    assert "error" not in result, result
    assert result["audio_bytes"] > 0
    await slots_freed()


async def test_sdk_websocket_manual_flushes_report_flush_done(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed
) -> None:
    result = await run_sdk(run_client, live_server, "--mode", "flush")
    assert "error" not in result, result
    events = result["events"]
    # The first transcript's audio carries flush_id 1, then its flush_done; the second's carries 2,
    # then flush_done 2; then done. Each flush_done once, after its last audio.
    first_done, second_done = events.index("flush_done:1"), events.index("flush_done:2")
    assert events[-1] == "done" and second_done == len(events) - 2
    assert {e.split(":")[0] for e in events[:first_done]} == {"chunk", "timestamps"}
    assert {e.split(":")[1] for e in events[:first_done]} == {"1"}
    assert {e.split(":")[0] for e in events[first_done + 1 : second_done]} == {"chunk", "timestamps"}
    assert {e.split(":")[1] for e in events[first_done + 1 : second_done]} == {"2"}
    assert result["words"] == {
        "1": ["Hello", "there,", "it", "is", "sunny", "today."],
        "2": ["Shall", "we", "walk", "to", "the", "park?"],
    }
    await slots_freed()


@pytest.mark.parametrize("mode", ["bytes", "sse"])
async def test_sdk_http_routes(
    live_server: LiveServer, run_client: ClientRunner, slots_freed: SlotsFreed, mode: str
) -> None:
    result = await run_sdk(run_client, live_server, "--mode", mode, "--sample-rate", "22050")
    assert "error" not in result, result
    if mode == "bytes":  # a WAV file at the requested rate
        assert result["head"] == "RIFF" and result["content_type"] == "audio/wav"
        assert (result["audio_bytes"] - 44) / 2 / 22050 > 0.3
    else:  # raw float32 chunks, word timestamps, done
        assert _seconds(result, 22050, bytes_per_sample=4) > 0.3
        assert result["types"] == ["chunk", "done", "timestamps"]
        assert " ".join(result["words"]) == "Hello there. How are you today?"
    await slots_freed()
