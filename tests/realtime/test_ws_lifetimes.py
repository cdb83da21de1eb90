"""Per-context resources on long-lived agent sockets end with the context, not with the socket.

The README's own usage is one socket per agent and one context per turn, so a socket may speak for
hours: every turn's task, resampler and queues must go when its context ends. The server runs in
this process, so its threads and memory are this process's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
from collections.abc import Awaitable, Callable

import pytest
from websockets.asyncio.client import ClientConnection, connect

from realtime.protocol.native import parse_audio_frame

pytestmark = pytest.mark.asyncio(loop_scope="session")

TURNS = 500
DIALECT_TURNS = 200
WARM_UP_TURNS = 40
# Turns in flight at once, within max_streams; each turn opens a context of its own.
LANES = 4
# Leak bounds (a turn used to keep its task, its resampler -- then two libav threads -- and ~1.3 MiB
# until the socket closed): a few threads of slack for the engines' and the loop's own pools, and far
# less memory than a leaked context per turn.
THREAD_SLACK = 4
RSS_SLACK_MIB = 64


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class Demux:
    """Reads one socket and hands each context's messages to whoever waits for that context."""

    def __init__(self, ws: ClientConnection, context_of: Callable[[str | bytes], str]) -> None:
        self._ws = ws
        self._context_of = context_of
        self._queues: dict[str, asyncio.Queue[str | bytes]] = {}
        self._reader = asyncio.create_task(self._read())

    def queue(self, context_id: str) -> asyncio.Queue[str | bytes]:
        return self._queues.setdefault(context_id, asyncio.Queue())

    def forget(self, context_id: str) -> None:
        del self._queues[context_id]

    async def _read(self) -> None:
        async for frame in self._ws:
            await self.queue(self._context_of(frame)).put(frame)

    async def aclose(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


async def speak_turns(turns: int, turn: Callable[[int, str], Awaitable[None]]) -> list[tuple[int, float]]:
    """Run `turns` turns, `LANES` at a time, turn n on context `turn-n`; sample (threads, RSS) once
    `WARM_UP_TURNS` are done and at the end."""
    samples = []
    finished = 0

    async def lane(number: int) -> None:
        nonlocal finished
        for index in range(number, turns, LANES):
            await turn(index, f"turn-{index}")
            finished += 1
            if finished == WARM_UP_TURNS:
                samples.append((threads(), rss_mib()))

    async with asyncio.TaskGroup() as group:
        for number in range(LANES):
            group.create_task(lane(number))
    samples.append((threads(), rss_mib()))
    return samples


def assert_flat(samples: list[tuple[int, float]]) -> None:
    (threads_before, rss_before), (threads_after, rss_after) = samples
    assert threads_after <= threads_before + THREAD_SLACK, samples
    assert rss_after - rss_before < RSS_SLACK_MIB, samples


def native_context(frame: str | bytes) -> str:
    return parse_audio_frame(frame)[0] if isinstance(frame, bytes) else json.loads(frame)["context_id"]


async def native_turn(
    ws: ClientConnection, frames: asyncio.Queue[str | bytes], context_id: str, index: int,
    sample_rate: int = 16000, **start: object,
) -> dict:
    """One turn on `context_id`: its audio bytes, chunk events and done."""
    await ws.send(json.dumps({"type": "start", "context_id": context_id, "sample_rate": sample_rate,
                              "fixed_length": 2, "seed": index, **start}))
    await ws.send(json.dumps({"type": "text", "context_id": context_id, "text": "Hi."}))
    await ws.send(json.dumps({"type": "end", "context_id": context_id}))
    audio, chunks = b"", []
    async with asyncio.timeout(60):
        while True:
            frame = await frames.get()
            if isinstance(frame, bytes):
                audio += parse_audio_frame(frame)[2]
                continue
            event = json.loads(frame)
            assert event["type"] in ("chunk", "done"), event
            if event["type"] == "done":
                return {"audio": audio, "chunks": chunks, "done": event}
            chunks.append(event)


async def test_500_turns_on_one_socket_keep_threads_and_memory_flat(live_server, eventually):
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        demux = Demux(ws, native_context)

        async def turn(index: int, context_id: str) -> None:
            got = await native_turn(ws, demux.queue(context_id), context_id, index)
            demux.forget(context_id)
            assert got["done"]["cancelled"] is False
            assert len(got["audio"]) == 2 * 640 * 2  # 2 tokens at 16 kHz, s16le

        try:
            samples = await speak_turns(TURNS, turn)
        finally:
            await demux.aclose()
    assert_flat(samples)
    await eventually(lambda: live_server.runtime.stats().active_streams == 0)


async def test_a_reused_context_id_starts_fresh(live_server):
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        demux = Demux(ws, native_context)
        try:
            first = await native_turn(ws, demux.queue("turn"), "turn", 0, sample_rate=16000)
            again = await native_turn(ws, demux.queue("turn"), "turn", 1, sample_rate=8000, encoding="mulaw")
        finally:
            await demux.aclose()
    assert len(first["audio"]) == 2 * 640 * 2
    # The second context's own rate and encoding (8 kHz µ-law: one byte per sample), its own seq.
    assert len(again["audio"]) == 2 * 320
    assert [chunk["seq"] for chunk in again["chunks"]] == list(range(len(again["chunks"])))
    assert again["chunks"][0]["start_s"] == 0.0


async def test_cartesia_turns_on_one_socket_keep_threads_and_memory_flat(live_server):
    output = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000}
    async with connect(f"{live_server.ws_url}/cartesia/tts/websocket") as ws:
        demux = Demux(ws, lambda frame: json.loads(frame)["context_id"])

        async def turn(index: int, context_id: str) -> None:
            await ws.send(json.dumps({"context_id": context_id, "transcript": "Hi.", "continue": False,
                                      "voice": {"mode": "id", "id": "default"}, "output_format": output}))
            frames, audio = demux.queue(context_id), b""
            async with asyncio.timeout(60):
                while (message := json.loads(await frames.get()))["type"] == "chunk":
                    audio += base64.b64decode(message["data"])
            assert message == {"type": "done", "done": True, "status_code": 206, "context_id": context_id}
            assert audio and len(audio) % 1280 == 0  # whole 25 Hz tokens at 16 kHz, s16le
            demux.forget(context_id)

        try:
            samples = await speak_turns(DIALECT_TURNS, turn)
        finally:
            await demux.aclose()
    assert_flat(samples)


async def test_a_pause_speaks_waiting_text_and_a_cancel_leaves_its_timer_nothing_to_do(live_server):
    """Text that waits for the input-streaming policy's timer is spoken when the timer fires, without an
    end; a context cancelled while its timer is pending gets nothing after its `done`."""
    start = {"type": "start", "fixed_length": 2, "max_buffer_delay_ms": 300, "clause_min_words": 0}
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        demux = Demux(ws, native_context)
        try:
            await ws.send(json.dumps({**start, "context_id": "paused", "seed": 1}))
            await ws.send(json.dumps({"type": "text", "context_id": "paused", "text": "Hello there"}))
            async with asyncio.timeout(30):  # spoken by the timer: no end, no flush was sent
                while not isinstance(await demux.queue("paused").get(), bytes):
                    pass
            await ws.send(json.dumps({"type": "end", "context_id": "paused"}))

            await ws.send(json.dumps({**start, "context_id": "cancelled", "seed": 2}))
            await ws.send(json.dumps({"type": "text", "context_id": "cancelled", "text": "Hello there"}))
            await ws.send(json.dumps({"type": "cancel", "context_id": "cancelled"}))
            frames = demux.queue("cancelled")
            async with asyncio.timeout(30):
                done = json.loads(await frames.get())
            assert done == {"type": "done", "context_id": "cancelled", "cancelled": True}
            await asyncio.sleep(1.0)  # past the 300 ms the timer was set for
            assert frames.empty()
        finally:
            await demux.aclose()


async def test_a_contexts_later_text_is_not_first_audio(live_server, monkeypatch):
    """The context's second sentence is a session of its own, but its listener already hears the first:
    its stream is opened as not first audio (no first-audio call waits for it) and its chunks carry
    deadlines behind the audio before them, so only the context's first chunk is due at once."""
    opened: list[bool] = []
    dues: list[float] = []
    for worker in live_server.runtime._workers:  # the instances: another test may have patched one

        async def recording_open_stream(speaker, first_audio=True, open_stream=worker.open_stream):
            opened.append(first_audio)
            return await open_stream(speaker, first_audio)

        async def recording_synthesize(stream, tokens, last, due, synthesize=worker.synthesize):
            dues.append(due)
            return await synthesize(stream, tokens, last, due)

        monkeypatch.setattr(worker, "open_stream", recording_open_stream)
        monkeypatch.setattr(worker, "synthesize", recording_synthesize)
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        demux = Demux(ws, native_context)
        try:
            await ws.send(json.dumps({"type": "start", "context_id": "two", "fixed_length": 30, "seed": 3}))
            text = "First one. Then another."
            await ws.send(json.dumps({"type": "text", "context_id": "two", "text": text}))
            await ws.send(json.dumps({"type": "end", "context_id": "two"}))
            async with asyncio.timeout(60):
                while not (isinstance(frame := await demux.queue("two").get(), str)
                           and json.loads(frame)["type"] == "done"):
                    pass
        finally:
            await demux.aclose()
    assert opened == [True, False]
    assert len(dues) >= 4 and dues[0] == -math.inf
    assert all(math.isfinite(due) for due in dues[1:])
