"""A server that requires an API key, driven by each vendor's own client code configured with that key:
the key travels the way the client sends it (Cartesia SDK: `X-API-Key` over HTTP and on its websocket;
Pipecat's Cartesia service: `?api_key=` on the websocket; LiveKit's Cartesia plugin: `?api_key=` and
`X-API-Key`; ElevenLabs' SDK and Pipecat's ElevenLabs services: `xi-api-key`; the OpenAI client inside
Pipecat and LiveKit: `Authorization: Bearer`). Refusals of missing and wrong keys in each dialect's
shape are tested in tests/realtime/test_access.py."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from harness import ClientRunner
from testing import LiveServer, serve, service_config

from realtime.config import AccessConfig

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY = "client-key-97531"


async def run_with_key(
    run_client: ClientRunner, server: LiveServer, env: str, script: str, mode: str
) -> dict[str, Any]:
    """`script`'s result, its client in `mode` configured with KEY against `server`."""
    return await run_client(env, script, "--http-url", server.http_url, "--mode", mode, "--api-key", KEY)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keyed(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LiveServer]:
    config = service_config(
        tiny_models, tmp_path_factory.mktemp("voices"), access=AccessConfig(api_keys=(KEY,))
    )
    async with serve(config) as server:
        yield server


@pytest.mark.parametrize("mode", ["websocket", "bytes"])
async def test_cartesia_sdk_with_a_key(keyed: LiveServer, run_client: ClientRunner, mode: str) -> None:
    result = await run_with_key(run_client, keyed, "vendor-sdks", "cartesia_sdk.py", mode)
    assert "error" not in result, result
    assert result["audio_bytes"] > 0


async def test_elevenlabs_sdk_with_a_key(keyed: LiveServer, run_client: ClientRunner) -> None:
    result = await run_with_key(run_client, keyed, "vendor-sdks", "elevenlabs_sdk.py", "convert")
    assert len(base64.b64decode(result["audio_b64"])) > 0


@pytest.mark.parametrize("mode", ["cartesia", "openai"])
async def test_pipecat_services_with_a_key(keyed: LiveServer, run_client: ClientRunner, mode: str) -> None:
    result = await run_with_key(run_client, keyed, "pipecat", "pipecat_tts.py", mode)
    assert result["errors"] == [], result["_stderr"][-3000:]
    assert result["audio_bytes"] > 0


async def test_pipecat_elevenlabs_websocket_with_a_key(keyed: LiveServer, run_client: ClientRunner) -> None:
    result = await run_with_key(run_client, keyed, "pipecat", "pipecat_elevenlabs.py", "websocket")
    assert result["errors"] == []
    assert result["audio_bytes"] > 0


async def test_livekit_cartesia_stream_with_a_key(keyed: LiveServer, run_client: ClientRunner) -> None:
    result = await run_with_key(run_client, keyed, "livekit", "livekit_tts.py", "cartesia-stream")
    assert result["errors"] == [], result["_stderr"][-3000:]
    assert result["audio_bytes"] > 0
