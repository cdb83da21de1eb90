"""Memory-aware admission: a stream is admitted only while its token2wav state's bound fits its worker's
byte budget (here a CPU server with a configured budget), else refused `busy` like the stream-count
limit, and its bytes come back however it ends."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx
import pytest
import torch
from testing import serve, service_config
from websockets.asyncio.client import ClientConnection, connect

from engines.config import ModelPaths, configs_for_models_dir
from engines.llm.base import SamplingParams
from engines.token2wav.base import ChunkJob, LaunchedChunks
from engines.token2wav.stream_memory import stream_state_bytes
from engines.token2wav.torch_backend import TorchToken2Wav
from engines.voice import VoicePrompt
from realtime.memory_budget import MemoryBudgets, device_budgets
from realtime.placement import WorkerLoad, least_loaded
from realtime.runtime import Runtime
from realtime.session import Segment, SpeechRequest

FLOAT32_BYTES = 4  # the flow's dtype on the CPU
LLM_CONTEXT = 2048  # the PyTorch LLM engine's default context: the most tokens of one request
Eventually = Callable[[Callable[[], bool]], Awaitable[None]]


def test_placement_needs_room_in_bytes_as_in_streams() -> None:
    full_in_bytes = WorkerLoad(1, 4, reserved_bytes=90, budget_bytes=100)
    assert least_loaded([full_in_bytes, WorkerLoad(3, 4)], [20, 20]) == 1
    assert least_loaded([full_in_bytes], [10]) == 0  # exactly fits
    assert least_loaded([full_in_bytes, WorkerLoad(4, 4)], [20, 20]) is None
    # A budget smaller than one stream still lets a worker with no stream take one.
    assert least_loaded([WorkerLoad(0, 4, budget_bytes=10)], [20]) == 0
    assert least_loaded([WorkerLoad(1, 4, reserved_bytes=20, budget_bytes=10)], [20]) is None
    # The larger share in use decides: 1/4 of the streams but 90 % of the bytes loses to 2/4 streams.
    assert least_loaded([WorkerLoad(1, 4, reserved_bytes=90, budget_bytes=100),
                         WorkerLoad(2, 4, reserved_bytes=0, budget_bytes=100)], [5, 5]) == 1


def test_budgets_are_configured_or_none_off_cuda_and_reservations_outlive_them() -> None:
    cpu = torch.device("cpu")
    assert device_budgets([cpu, cpu], None, margin=8 << 30) == [None, None]  # the CPU: no byte limit
    assert device_budgets([cpu, cpu], 100, margin=8 << 30) == [100, 100]  # configured: per worker
    budgets = MemoryBudgets(2)
    assert budgets.budgets == (None, None) and budgets.reserved == (0, 0)
    budgets.reserve(1, 30)
    budgets.limit([100, 50])  # set after the warm-up: what is reserved stays
    assert budgets.budgets == (100, 50) and budgets.reserved == (0, 30)
    budgets.release(1, 30)
    assert budgets.reserved == (0, 0)
    with pytest.raises(ValueError, match="3 budgets for 2"):
        budgets.limit([1, 2, 3])


def default_stream_bytes(models: Path) -> int:
    """The bound the server reserves for one stream of the default voice."""
    configs = configs_for_models_dir(models)
    voice = VoicePrompt.load(ModelPaths(models).voices / "default.safetensors")
    return stream_state_bytes(configs.dit_flow, configs.hift, FLOAT32_BYTES, voice.prompt_mel.shape[0],
                              LLM_CONTEXT)


def reserved_bytes(metrics: str) -> float:
    return _gauge(metrics, "tts_token2wav_memory_reserved_bytes")


def _gauge(metrics: str, name: str) -> float:
    [line] = [line for line in metrics.splitlines() if line.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


async def next_event(ws: ClientConnection, context_id: str) -> dict:
    """The next JSON event of `context_id` (audio frames and other contexts' events skipped)."""
    async with asyncio.timeout(60):
        while True:
            frame = await ws.recv()
            if isinstance(frame, str) and (event := json.loads(frame)).get("context_id") == context_id:
                return event


async def start_context(ws: ClientConnection, context_id: str, tokens: int) -> None:
    await ws.send(json.dumps({"type": "start", "context_id": context_id, "fixed_length": tokens, "seed": 1,
                              "sample_rate": 24000, "encoding": "pcm_f32le"}))
    await ws.send(json.dumps({"type": "text", "context_id": context_id, "text": "Hello there."}))
    await ws.send(json.dumps({"type": "end", "context_id": context_id}))


async def test_a_budget_for_two_streams_admits_two_and_refuses_the_third(
    tiny_models: Path, tmp_path: Path, eventually: Eventually, monkeypatch: pytest.MonkeyPatch,
) -> None:
    failing = False
    launch_chunks = TorchToken2Wav.launch_chunks

    def fail_when_asked(self: TorchToken2Wav, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        if failing:
            raise RuntimeError("a failing batch")
        return launch_chunks(self, jobs)

    monkeypatch.setattr(TorchToken2Wav, "launch_chunks", fail_when_asked)
    bound = default_stream_bytes(tiny_models)
    budget = 2 * bound + bound // 2
    config = service_config(tiny_models, tmp_path, device="cpu", max_streams=8, retry_after_s=3,
                            token2wav_memory_gib=budget / (1 << 30))
    async with serve(config) as server, httpx.AsyncClient(base_url=server.http_url, timeout=60) as http:
        runtime = server.runtime

        async def reserved() -> float:
            return reserved_bytes((await http.get("/metrics")).text)

        metrics = (await http.get("/metrics")).text
        assert _gauge(metrics, "tts_token2wav_memory_budget_bytes") == pytest.approx(budget, abs=1)
        assert reserved_bytes(metrics) == 0

        # One stream held by a consumer that does not read (it waits after a few chunks), one on a
        # websocket whose client does not read: two bounds reserved, below the count limit of 8.
        held = await runtime.open_session(SpeechRequest("Hello there.",
                                                        sampling=SamplingParams(seed=1, fixed_length=1500)))
        held.start()
        assert await reserved() == bound
        async with connect(f"{server.ws_url}/v1/ws") as silent, connect(f"{server.ws_url}/v1/ws") as ws:
            await start_context(silent, "long", 1500)
            await eventually(lambda: runtime.stats().active_streams == 2)
            assert await reserved() == 2 * bound

            # The third is refused as the stream-count limit refuses: `busy` over the native
            # websocket, 429 with Retry-After over HTTP.
            await start_context(ws, "third", 2)
            refused = await next_event(ws, "third")
            assert (refused["type"], refused["code"]) == ("error", "busy")
            assert "memory" in refused["message"]
            speech = {"model": "tts-1", "voice": "default", "input": "Hello there.", "response_format": "pcm"}
            answer = await http.post("/v1/audio/speech", json=speech)
            assert (answer.status_code, answer.json()["error"]["code"]) == (429, "busy")
            assert answer.headers["retry-after"] == "3"

            # The silent client goes away: its stream ends and gives its bytes back; a new one fits.
            await silent.close()
            await eventually(lambda: runtime.stats().active_streams == 1)
            assert await reserved() == bound
            await start_context(ws, "again", 2)
            while (event := await next_event(ws, "again"))["type"] == "chunk":
                pass
            assert event == {"type": "done", "context_id": "again", "cancelled": False}
            assert await reserved() == bound  # done: given back

            # Cancelled: given back too.
            await start_context(ws, "cancelled", 1500)
            await eventually(lambda: runtime.stats().active_streams == 2)
            await ws.send(json.dumps({"type": "cancel", "context_id": "cancelled"}))
            while (event := await next_event(ws, "cancelled"))["type"] == "chunk":
                pass
            assert event == {"type": "done", "context_id": "cancelled", "cancelled": True}
            await eventually(lambda: runtime.stats().active_streams == 1)
            assert await reserved() == bound

            # Failed in synthesis: given back too.
            failing = True
            await start_context(ws, "failed", 2)
            failed = await next_event(ws, "failed")
            assert (failed["type"], failed["code"]) == ("error", "internal_error")
            await eventually(lambda: runtime.stats().active_streams == 1)
            assert await reserved() == bound
        await held.aclose()
        assert await reserved() == 0


async def test_a_session_cancelled_while_its_text_is_cut_gives_its_bytes_back(
    tiny_models: Path, tmp_path: Path, eventually: Eventually, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`open_session` cancelled (a client gone) while the text is normalised and cut, after admission:
    no caller ever holds that session, so it closes itself, giving back its stream and its bytes. (A text
    with digits: those are cut on a worker thread, which this test holds; quick text is cut on the loop.)"""
    cutting, go_on = threading.Event(), threading.Event()
    segments = Runtime._segments

    def slow_segments(self: Runtime, text: str) -> list[Segment]:
        cutting.set()
        go_on.wait()
        return segments(self, text)

    monkeypatch.setattr(Runtime, "_segments", slow_segments)
    bound = default_stream_bytes(tiny_models)
    config = service_config(tiny_models, tmp_path, device="cpu", token2wav_memory_gib=4 * bound / (1 << 30))
    async with serve(config) as server:
        runtime = server.runtime
        try:
            opening = asyncio.ensure_future(runtime.open_session(SpeechRequest("Hello, table 4.")))
            await asyncio.to_thread(cutting.wait)
            assert runtime.stats().active_streams == 1
            assert reserved_bytes(runtime.metrics.render().decode()) == bound
            opening.cancel()
            with pytest.raises(asyncio.CancelledError):
                await opening
            assert runtime.stats().active_streams == 0
            assert reserved_bytes(runtime.metrics.render().decode()) == 0
        finally:
            go_on.set()


@pytest.mark.parametrize("room", ["bytes", "streams"])
async def test_a_context_with_room_for_one_stream_speaks_its_texts_one_after_the_other(
    tiny_models: Path, tmp_path: Path, room: str,
) -> None:
    """While a context's text plays, its next text's session opens beside it (no gap between sentences).
    With no room for that second stream (the byte budget, or the stream limit, holds one), the next text
    must wait for the first to end, not fail the context: a `busy` for the prefetch ended the text that
    was playing."""
    bound = default_stream_bytes(tiny_models)
    limit = ({"max_streams": 8, "token2wav_memory_gib": (bound + bound // 2) / (1 << 30)} if room == "bytes"
             else {"max_streams": 1})
    config = service_config(tiny_models, tmp_path, device="cpu", **limit)
    async with serve(config) as server, connect(f"{server.ws_url}/v1/ws") as ws:
        await ws.send(json.dumps({"type": "start", "context_id": "two", "fixed_length": 40, "seed": 1,
                                  "sample_rate": 24000, "encoding": "pcm_f32le"}))
        for text in ("Hello there.", "How are you today?"):
            await ws.send(json.dumps({"type": "text", "context_id": "two", "text": text}))
        await ws.send(json.dumps({"type": "end", "context_id": "two"}))
        finals = 0
        while (event := await next_event(ws, "two"))["type"] == "chunk":
            finals += event["final"]
        assert event == {"type": "done", "context_id": "two", "cancelled": False}
        assert finals == 2  # each text spoken to its end
        assert reserved_bytes(server.runtime.metrics.render().decode()) == 0
