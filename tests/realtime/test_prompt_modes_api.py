"""Instructions and languages from every API reach the LLM engine as the right prompt mode.

What the real engine receives is recorded by wrapping its `submit` (the engine still serves every
request); the expected prompts are built here from the tokenizer and the voice file.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from engines.build.synthetic import DEFAULT_VOICE_TEXT
from engines.config import ModelPaths
from engines.llm.base import LLMRequest, PromptMode
from engines.voice import VoicePrompt
from realtime.prompts import PromptCache

pytestmark = pytest.mark.asyncio(loop_scope="session")

INSTRUCTION = "Speak slowly, in a calm and warm voice."


@pytest.fixture
def received(live_server, monkeypatch) -> Iterator[list[LLMRequest]]:
    """Every LLM request the running engines get while the test runs."""
    requests: list[LLMRequest] = []
    for engine in live_server.runtime._engines.llms:

        def recording(request: LLMRequest, submit=engine.submit):  # type: ignore[no-untyped-def]
            requests.append(request)
            return submit(request)

        monkeypatch.setattr(engine, "submit", recording)
    yield requests


def frontend(server):  # type: ignore[no-untyped-def]
    return server.runtime._engines.text


def instruction_ids(server, instruction: str = INSTRUCTION) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    text = frontend(server)
    return (*text.encode(instruction), text.token_id("<|endofprompt|>"))


def default_voice(server) -> VoicePrompt:  # type: ignore[no-untyped-def]
    return VoicePrompt.load(ModelPaths(server.config.models_dir).voices / "default.safetensors")


def assert_mode(request: LLMRequest, mode: PromptMode, server, instruction: str = INSTRUCTION) -> None:  # type: ignore[no-untyped-def]
    assert request.mode is mode
    if mode is PromptMode.ZERO_SHOT:
        voice = default_voice(server)
        assert tuple(request.prompt_text_ids) == tuple(frontend(server).encode(DEFAULT_VOICE_TEXT))
        assert tuple(request.prompt_speech_tokens) == tuple(voice.speech_tokens.tolist())
    elif mode is PromptMode.CROSS_LINGUAL:
        assert tuple(request.prompt_text_ids) == () and tuple(request.prompt_speech_tokens) == ()
    else:
        assert tuple(request.prompt_text_ids) == instruction_ids(server, instruction)
        assert tuple(request.prompt_speech_tokens) == ()


# -- OpenAI HTTP ----------------------------------------------------------------------------------


async def test_openai_instructions_speak_in_instruct2(live_server, received):
    client = openai.AsyncOpenAI(base_url=f"{live_server.http_url}/v1", api_key="unused", max_retries=0)
    for instructions, mode in ((INSTRUCTION, PromptMode.INSTRUCT2), (None, PromptMode.ZERO_SHOT)):
        extra = {"instructions": instructions} if instructions else {}
        response = await client.audio.speech.create(
            model="gpt-4o-mini-tts", voice="default", input="Hello there.", response_format="pcm",
            extra_body={"fixed_length": 6}, **extra)
        assert len(response.content) > 0
        assert_mode(received[-1], mode, live_server)
        assert list(received[-1].text_ids) == frontend(live_server).encode("Hello there.")


async def test_openai_language_and_mode_extensions(live_server, received):
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        for extension, mode in (({"language": "zh-CN"}, PromptMode.CROSS_LINGUAL),
                                ({"language": "EN"}, PromptMode.ZERO_SHOT),
                                ({"mode": "cross_lingual"}, PromptMode.CROSS_LINGUAL)):
            body = {"input": "Hi.", "voice": "default", "response_format": "pcm", "fixed_length": 4,
                    **extension}
            response = await http.post("/v1/audio/speech", json=body)
            assert response.status_code == 200 and response.content
            assert_mode(received[-1], mode, live_server)


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"instructions": "calm " * 400}, "instructions", "instructions_too_long"),
    ({"language": "english!"}, "language", "invalid_language"),
    ({"mode": "instruct2"}, "mode", "missing_instructions"),
    ({"mode": "instruct"}, "mode", "invalid_mode"),
    ({"mode": "zero_shot", "instructions": INSTRUCTION}, "mode", "invalid_mode"),
    ({"instructions": 5}, "instructions", "invalid_type"),
])
async def test_openai_style_errors_name_the_field(live_server, received, body, param, code):
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        response = await http.post("/v1/audio/speech", json={"input": "Hi.", "voice": "default", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and error["message"]
    assert received == []


async def test_a_mode_the_engine_does_not_serve_is_refused(live_server, received, monkeypatch):
    for engine in live_server.runtime._engines.llms:
        monkeypatch.setattr(engine, "modes", frozenset({PromptMode.ZERO_SHOT}))
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        body = {"input": "Hi.", "voice": "default", "instructions": INSTRUCTION}
        response = await http.post("/v1/audio/speech", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "mode_not_supported"
    assert received == []


# -- native websocket --------------------------------------------------------------------------------


async def native_context(server, start: dict) -> list[dict]:  # type: ignore[type-arg]
    async with connect(f"{server.ws_url}/v1/ws") as ws:
        await ws.send(json.dumps({"type": "start", "context_id": "c", "voice": "default", "fixed_length": 5,
                                  **start}))
        await ws.send(json.dumps({"type": "text", "context_id": "c", "text": "Hello there."}))
        await ws.send(json.dumps({"type": "end", "context_id": "c"}))
        events = []
        async with asyncio.timeout(60):
            while True:
                message = await ws.recv()
                if isinstance(message, str):
                    events.append(json.loads(message))
                    if events[-1]["type"] in ("done", "error"):
                        return events


@pytest.mark.parametrize(("start", "mode"), [
    ({"instructions": INSTRUCTION}, PromptMode.INSTRUCT2),
    ({"language": "ja"}, PromptMode.CROSS_LINGUAL),
    ({"language": "en"}, PromptMode.ZERO_SHOT),
    ({"mode": "cross_lingual"}, PromptMode.CROSS_LINGUAL),
    ({"instructions": INSTRUCTION, "language": "zh"}, PromptMode.INSTRUCT2),
])
async def test_native_context_style_fields(live_server, received, start, mode):
    events = await native_context(live_server, start)
    assert events[-1] == {"type": "done", "context_id": "c", "cancelled": False}
    assert_mode(received[-1], mode, live_server)


async def test_native_style_errors(live_server, received):
    events = await native_context(live_server, {"language": "x1"})
    assert (events[-1]["type"], events[-1]["code"]) == ("error", "invalid_language")
    events = await native_context(live_server, {"instructions": "word " * 600})
    assert (events[-1]["type"], events[-1]["code"]) == ("error", "instructions_too_long")
    assert received == []


# -- Cartesia and ElevenLabs dialects ------------------------------------------------------------------


async def cartesia_turn(server, extra: dict) -> list[dict]:  # type: ignore[type-arg]
    message = {"context_id": "t", "model_id": "sonic-3", "transcript": "Hi.", "continue": False,
               "voice": {"mode": "id", "id": "default"},
               "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}, **extra}
    async with connect(f"{server.ws_url}/cartesia/tts/websocket") as ws:
        await ws.send(json.dumps(message))
        received = []
        async with asyncio.timeout(90):
            while not received or received[-1]["type"] not in ("done", "error"):
                received.append(json.loads(await ws.recv()))
        return received


async def test_cartesia_language_and_emotion(live_server, received):
    assert (await cartesia_turn(live_server, {"language": "de"}))[-1]["type"] == "done"
    assert_mode(received[-1], PromptMode.CROSS_LINGUAL, live_server)
    assert (await cartesia_turn(live_server, {"language": "en"}))[-1]["type"] == "done"
    assert_mode(received[-1], PromptMode.ZERO_SHOT, live_server)
    angry = {"language": "en", "generation_config": {"emotion": "angry", "speed": 1}}
    await cartesia_turn(live_server, angry)
    assert_mode(received[-1], PromptMode.INSTRUCT2, live_server, "请非常生气地说一句话。")
    controls = {"emotion": ["positivity:high"]}
    sonic2 = {"voice": {"mode": "id", "id": "default", "__experimental_controls": controls}}
    await cartesia_turn(live_server, sonic2)
    assert_mode(received[-1], PromptMode.INSTRUCT2, live_server, "请非常开心地说一句话。")
    # An emotion CosyVoice2 was not instructed with: ignored.
    await cartesia_turn(live_server, {"generation_config": {"emotion": "curiosity"}})
    assert_mode(received[-1], PromptMode.ZERO_SHOT, live_server)
    # The HTTP route reads the same fields.
    body = {"model_id": "sonic-3", "transcript": "Hi.", "voice": {"mode": "id", "id": "default"},
            "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        assert (await http.post("/cartesia/tts/bytes", json={**body, "language": "es"})).status_code == 200
        assert_mode(received[-1], PromptMode.CROSS_LINGUAL, live_server)
        sad = {**body, "generation_config": {"emotion": "sad"}}
        assert (await http.post("/cartesia/tts/bytes", json=sad)).status_code == 200
        assert_mode(received[-1], PromptMode.INSTRUCT2, live_server, "请非常伤心地说一句话。")


async def test_elevenlabs_language_code(live_server, received):
    for language, mode in (("fr", PromptMode.CROSS_LINGUAL), ("en", PromptMode.ZERO_SHOT)):
        url = f"{live_server.ws_url}/v1/text-to-speech/default/stream-input?language_code={language}"
        async with connect(url) as ws:
            await ws.send(json.dumps({"text": " "}))
            await ws.send(json.dumps({"text": "Hi there."}))
            await ws.send(json.dumps({"text": ""}))
            async with asyncio.timeout(90):
                while not json.loads(await ws.recv()).get("isFinal"):
                    pass
        assert_mode(received[-1], mode, live_server)
    async with connect(f"{live_server.ws_url}/v1/text-to-speech/default/stream-input?language_code=!!") as ws:
        assert json.loads(await ws.recv())["error"] == "invalid_language"
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        response = await http.post("/v1/text-to-speech/default", params={"output_format": "pcm_24000"},
                                   json={"text": "Hi.", "language_code": "ja"})
        assert response.status_code == 200 and response.content
    assert_mode(received[-1], PromptMode.CROSS_LINGUAL, live_server)


# -- voices and the cache ---------------------------------------------------------------------------


async def test_an_uploaded_voice_records_its_language(live_server, received):
    from test_voices_api import upload, wav_bytes

    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        response = await upload(http, "zh-voice", wav_bytes(2.0), "希望你以后能够做的比我还好呦。")
        assert response.status_code == 201 and response.json()["language"] == "zh"
        try:
            voices = {v["voice_id"]: v["language"] for v in (await http.get("/v1/voices")).json()["data"]}
            assert voices["default"] == "en" and voices["zh-voice"] == "zh"
            for language, mode in (("en", PromptMode.CROSS_LINGUAL), ("zh", PromptMode.ZERO_SHOT)):
                body = {"input": "Hi.", "voice": "zh-voice", "response_format": "pcm", "fixed_length": 3,
                        "language": language}
                assert (await http.post("/v1/audio/speech", json=body)).status_code == 200
                assert received[-1].mode is mode
        finally:
            await http.delete("/v1/voices/zh-voice")


async def test_a_repeated_instruction_reuses_its_prompt(live_server, received):
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        body = {"input": "Hi.", "voice": "default", "response_format": "pcm", "fixed_length": 3,
                "instructions": "Whisper, please."}
        for _ in range(2):
            assert (await http.post("/v1/audio/speech", json=body)).status_code == 200
    first, second = received[-2:]
    assert first.prompt_text_ids is second.prompt_text_ids  # one tokenization, shared


async def test_the_prompt_cache_is_bounded_and_forgets_removed_voices(live_server):
    runtime = live_server.runtime
    cache = PromptCache(frontend(live_server), capacity=2)
    voice = runtime._prepared["default"][0]
    first = cache.get(voice, PromptMode.INSTRUCT2, "one")
    assert cache.get(voice, PromptMode.INSTRUCT2, "one") is first
    cache.get(voice, PromptMode.INSTRUCT2, "two")
    cache.get(voice, PromptMode.ZERO_SHOT, None)
    assert len(cache) == 2 and cache.get(voice, PromptMode.INSTRUCT2, "one") is not first
    cache.forget("default")
    assert len(cache) == 0


async def test_token2wav_gets_the_voices_speaker_in_every_mode(live_server, received, monkeypatch):
    opened = []
    for worker in live_server.runtime._workers:

        async def recording(speaker, first_audio=True, open_stream=worker.open_stream):  # type: ignore[no-untyped-def]
            opened.append(speaker)
            return await open_stream(speaker, first_audio)

        monkeypatch.setattr(worker, "open_stream", recording)
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        for extension in ({}, {"language": "zh"}, {"instructions": INSTRUCTION}):
            body = {"input": "Hi.", "voice": "default", "response_format": "pcm", "fixed_length": 3,
                    **extension}
            assert (await http.post("/v1/audio/speech", json=body)).status_code == 200
    speakers = {id(voice.speaker) for voice in live_server.runtime._prepared["default"]}
    assert [r.mode for r in received] == list(PromptMode)
    assert len(opened) == 3 and all(id(speaker) in speakers for speaker in opened)
