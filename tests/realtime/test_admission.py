"""Admission policy: refuse beyond the stream limit or when the engines are backed up."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from testing import serve, service_config

from engines.llm.auto import select_llm
from engines.llm.base import SamplingParams
from realtime.admission import AdmissionPolicy, Admit, Load, Refuse
from realtime.config import ServiceConfig
from realtime.engine_loader import LLMsChosen, LoadedEngines, load_engines
from realtime.runtime import Runtime
from realtime.session import ServiceError, Session, SpeechRequest


def test_admits_below_the_limit_and_refuses_at_it():
    policy = AdmissionPolicy.for_streams(2, retry_after_s=3)
    assert policy.decide(Load(active_streams=1)) == Admit()
    refused = policy.decide(Load(active_streams=2))
    assert isinstance(refused, Refuse) and refused.retry_after_s == 3 and "2 concurrent" in refused.reason


def test_refuses_when_engine_queues_are_too_deep():
    policy = AdmissionPolicy(max_streams=10, max_llm_waiting=1, max_token2wav_queue=4)
    assert isinstance(policy.decide(Load(0, llm_waiting=2)), Refuse)
    assert isinstance(policy.decide(Load(0, token2wav_queue=5)), Refuse)
    assert policy.decide(Load(0, llm_waiting=1, token2wav_queue=4)) == Admit()


def test_invalid_limits_are_refused():
    with pytest.raises(ValueError):
        AdmissionPolicy(max_streams=0, max_llm_waiting=0, max_token2wav_queue=1)


def one_slot_one_waiting(config: ServiceConfig, on_llms: LLMsChosen | None = None) -> LoadedEngines:
    """The engines of `config` with an LLM that decodes one request and queues one more."""
    loaded = load_engines(config)
    llm = select_llm(config.models_dir, "torch", "cpu", max_slots=1, max_waiting=1)
    return dataclasses.replace(loaded, llms=(llm,))


async def fill_llm_line(runtime: Runtime, eventually: Callable[[Callable[[], bool]], Awaitable[None]]
                        ) -> list[Session]:
    """Two long streams: one decoding in the LLM's one slot, one in its waiting line."""
    long = SamplingParams(seed=1, fixed_length=1000)
    holding = await runtime.open_session(SpeechRequest("Hello there.", sampling=long))
    holding.start()
    await eventually(lambda: runtime.stats().llm_active == 1)
    waiting = await runtime.open_session(SpeechRequest("Hello there.", sampling=long))
    waiting.start()
    await eventually(lambda: runtime.stats().llm_waiting == 1)
    return [holding, waiting]


async def test_a_full_llm_waiting_line_is_busy_with_retry_after(
    tiny_models: Path,
    tmp_path: Path,
    eventually: Callable[[Callable[[], bool]], Awaitable[None]],
) -> None:
    """Admission let the stream in, but the LLM engine's own waiting line is full when its sentence is
    submitted: the client gets the same `busy` answer (429, Retry-After) as from admission."""

    config = ServiceConfig(models_dir=tiny_models, voices_dir=tmp_path, device="cpu", max_streams=4,
                           retry_after_s=3)
    runtime = Runtime(config, loader=one_slot_one_waiting)
    await runtime.start()
    try:
        held = await fill_llm_line(runtime, eventually)
        refused = await runtime.open_session(SpeechRequest("Hello there."))
        with pytest.raises(ServiceError) as busy:
            async for _ in refused:
                pass
        assert (busy.value.code, busy.value.http_status, busy.value.retry_after_s) == ("busy", 429, 3)
        for session in held:
            await session.aclose()
    finally:
        await runtime.stop(config.drain_timeout_s)


async def test_http_routes_answer_an_error_before_audio_with_its_status(
    tiny_models: Path,
    tmp_path: Path,
    eventually: Callable[[Callable[[], bool]], Awaitable[None]],
) -> None:
    """An error that comes after admission but before any audio (here the LLM's waiting line is full)
    reaches an HTTP client as its status and its API's error shape, not as a 200 with a short body:
    OpenAI, Cartesia bytes and the ElevenLabs routes wait for the first chunk before answering."""
    config = service_config(tiny_models, tmp_path, device="cpu", retry_after_s=3)
    cartesia = {"model_id": "sonic-3", "transcript": "Hello there.", "voice": {"mode": "id", "id": "default"},
                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000}}
    async with serve(config, one_slot_one_waiting) as server, httpx.AsyncClient(
        base_url=server.http_url, timeout=60
    ) as http:
        held = await fill_llm_line(server.runtime, eventually)
        speech = {"model": "tts-1", "voice": "default", "input": "Hello there.", "response_format": "pcm"}
        openai = await http.post("/v1/audio/speech", json=speech)
        assert (openai.status_code, openai.json()["error"]["code"]) == (429, "busy")
        bytes_ = await http.post("/cartesia/tts/bytes", json=cartesia)
        assert (bytes_.status_code, bytes_.json()["error_code"]) == (429, "busy")
        for route in ("", "/stream", "/stream/with-timestamps", "/with-timestamps"):
            eleven = await http.post(f"/v1/text-to-speech/default{route}", json={"text": "Hello there."})
            assert (eleven.status_code, eleven.json()["detail"]["status"]) == (429, "busy"), route
            assert eleven.headers["retry-after"] == "3"
        for session in held:
            await session.aclose()
