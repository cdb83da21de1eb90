"""The official openai SDK (our own test dependency) with OpenAI's voice names: they resolve through
the alias table to the `default` voice."""

from __future__ import annotations

import openai
import pytest
from harness import SlotsFreed
from testing import LiveServer

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.mark.parametrize("voice", ["alloy", "ash", "coral", "shimmer"])
async def test_openai_voice_names_speak_the_default_voice(
    live_server: LiveServer, slots_freed: SlotsFreed, voice: str
) -> None:
    client = openai.AsyncOpenAI(api_key="not-checked", base_url=f"{live_server.http_url}/v1")
    async with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice=voice, input="Hello there.", response_format="pcm"
    ) as response:
        audio = await response.read()
    await client.close()
    assert len(audio) % 2 == 0 and len(audio) / 2 / 24000 > 0.2
    await slots_freed()


async def test_an_unknown_voice_is_still_refused(live_server: LiveServer) -> None:
    client = openai.AsyncOpenAI(api_key="not-checked", base_url=f"{live_server.http_url}/v1", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="voice"):
        await client.audio.speech.create(model="tts-1", voice="nobody", input="Hello.")
    await client.close()
