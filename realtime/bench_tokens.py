"""Token-paced benchmark: how soon an LLM turn streamed token by token starts speaking.

One agent turn (`TURN`) is sent one word-sized token at a time at an LLM's pace (`token_interval_s`)
over a fresh socket, then the turn is ended, as each client sends it:

- `native`: `/v1/ws` text messages, one per token, each with the whitespace it carries;
- `cartesia`: `/cartesia/tts/websocket` transcripts with `continue: true` and no buffering hint (the
  Cartesia SDK's `push`, Pipecat's token mode);
- `cartesia-sentences`: Pipecat's default: its own sentence aggregation, each sentence sent whole,
  without a trailing space, with `max_buffer_delay_ms: 0`;
- `elevenlabs`, `elevenlabs-sentences`, `elevenlabs-livekit`: the multi-context ElevenLabs websocket
  fed tokens without `auto_mode`, Pipecat's default (sentences without a trailing space, `auto_mode`)
  and LiveKit's default (sentences with a trailing space and `flush`, `auto_mode`).

The figure is the time from sending the first sentence's last token (for `cartesia-sentences`, the
first sentence) to the first audio byte, per turn; the context is cancelled at the first audio.

`realtime bench --token-paced` runs it (other dialects add their shapes to `CLIENTS`).
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import websockets
from websockets.asyncio.client import ClientConnection

TURN = "Hello there, it is sunny today. Shall we walk to the park? It is a fine day to be outside."
FIRST_SENTENCE = "Hello there, it is sunny today."


def turn_tokens() -> list[str]:
    """`TURN` as an LLM streams it: word-sized pieces, each with the whitespace before it."""
    return re.findall(r"\s*\S+", TURN)


def turn_sentences() -> list[str]:
    """`TURN` as a sentence aggregator hands it on: whole sentences, no surrounding whitespace."""
    return re.findall(r"\S.*?[.!?](?=\s|$)", TURN)


@dataclass(frozen=True)
class ClientShape:
    """How one client sends a turn and recognises audio."""

    path: str
    pieces: Callable[[], list[str]]
    is_last_piece_of_first_sentence: Callable[[int, str], bool]
    start: Callable[[str], list[str]]  # frames before the first piece
    piece: Callable[[str, str], str]  # (context id, text) -> frame
    end: Callable[[str], str]  # the frame that ends the turn
    is_audio: Callable[[str | bytes], bool]


def _first_sentence_ends(index: int, piece: str) -> bool:
    return "".join(turn_tokens()[: index + 1]).strip() == FIRST_SENTENCE


def _native_start(cid: str) -> list[str]:
    return [json.dumps({"type": "start", "context_id": cid, "voice": "default"})]


def _cartesia_message(cid: str, text: str, **extra: object) -> str:
    return json.dumps({
        "context_id": cid, "transcript": text, "continue": True, "model_id": "sonic-3",
        "voice": {"mode": "id", "id": "default"},
        "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}, **extra,
    })


def _cartesia_end(cid: str) -> str:
    return json.dumps({**json.loads(_cartesia_message(cid, "")), "continue": False})


def _cartesia_audio(frame: str | bytes) -> bool:
    return isinstance(frame, str) and json.loads(frame).get("type") == "chunk"


def _elevenlabs_path(auto_mode: bool) -> str:
    query = "output_format=pcm_24000" + ("&auto_mode=true" if auto_mode else "")
    return f"/v1/text-to-speech/default/multi-stream-input?{query}"


def _elevenlabs_text(cid: str, text: str, **extra: object) -> str:
    return json.dumps({"text": text, "context_id": cid, **extra})


def _elevenlabs_audio(frame: str | bytes) -> bool:
    return isinstance(frame, str) and bool(json.loads(frame).get("audio"))


CLIENTS: dict[str, ClientShape] = {
    "native": ClientShape(
        "/v1/ws", turn_tokens, _first_sentence_ends, _native_start,
        lambda cid, text: json.dumps({"type": "text", "context_id": cid, "text": text}),
        lambda cid: json.dumps({"type": "end", "context_id": cid}),
        lambda frame: isinstance(frame, bytes),
    ),
    "cartesia": ClientShape(
        "/cartesia/tts/websocket", turn_tokens, _first_sentence_ends, lambda cid: [],
        _cartesia_message, _cartesia_end, _cartesia_audio,
    ),
    "cartesia-sentences": ClientShape(
        "/cartesia/tts/websocket", turn_sentences, lambda index, piece: index == 0, lambda cid: [],
        lambda cid, text: _cartesia_message(cid, text, max_buffer_delay_ms=0), _cartesia_end, _cartesia_audio,
    ),
    # ElevenLabs' multi-context websocket: a context opened with " ", ended by a flush.
    "elevenlabs": ClientShape(  # tokens, no auto_mode (Pipecat's token mode, LiveKit with a schedule)
        _elevenlabs_path(False), turn_tokens, _first_sentence_ends,
        lambda cid: [_elevenlabs_text(cid, " ")], _elevenlabs_text,
        lambda cid: _elevenlabs_text(cid, "", flush=True), _elevenlabs_audio,
    ),
    "elevenlabs-sentences": ClientShape(  # Pipecat's default: auto_mode, sentences without a trailing space
        _elevenlabs_path(True), turn_sentences, lambda index, piece: index == 0,
        lambda cid: [_elevenlabs_text(cid, " ")], _elevenlabs_text,
        lambda cid: _elevenlabs_text(cid, "", flush=True), _elevenlabs_audio,
    ),
    "elevenlabs-livekit": ClientShape(  # LiveKit's default: auto_mode, each sentence + " " with flush
        _elevenlabs_path(True), turn_sentences, lambda index, piece: index == 0,
        lambda cid: [_elevenlabs_text(cid, " ")],
        lambda cid, text: _elevenlabs_text(cid, text + " ", flush=True),
        lambda cid: _elevenlabs_text(cid, "", flush=True), _elevenlabs_audio,
    ),
}


async def one_turn(ws_base: str, shape: ClientShape, token_interval_s: float, cid: str) -> float:
    """Seconds from the first sentence's last piece to the first audio byte of one turn."""
    async with websockets.connect(ws_base + shape.path, max_size=None) as ws:
        sentence_sent_at: list[float] = []

        async def send() -> None:
            for frame in shape.start(cid):
                await ws.send(frame)
            pieces = shape.pieces()
            for index, piece in enumerate(pieces):
                await ws.send(shape.piece(cid, piece))
                if shape.is_last_piece_of_first_sentence(index, piece):
                    sentence_sent_at.append(time.perf_counter())
                # A sentence aggregator hands on a sentence once its last token arrived.
                words = len(piece.split()) if shape.pieces is turn_sentences else 1
                await asyncio.sleep(token_interval_s * words)
            await ws.send(shape.end(cid))

        async def first_audio(ws: ClientConnection) -> float:
            async for frame in ws:
                if shape.is_audio(frame):
                    return time.perf_counter()
            raise RuntimeError("the socket closed before any audio")

        sender = asyncio.create_task(send())
        try:
            heard_at = await asyncio.wait_for(first_audio(ws), 120)
        finally:
            sender.cancel()
        if not sentence_sent_at:
            raise RuntimeError("audio arrived before the first sentence was sent")
        return heard_at - sentence_sent_at[0]


@dataclass(frozen=True)
class TokenPacedResult:
    client: str
    turns: int
    first_audio_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.first_audio_ms)


async def run_token_paced(
    ws_base: str, clients: Sequence[str], turns: int, token_interval_s: float
) -> list[TokenPacedResult]:
    results = []
    await one_turn(ws_base, CLIENTS["native"], token_interval_s, "warmup")  # lazy initialisation
    for name in clients:
        shape = CLIENTS[name]
        times = [
            1000 * await one_turn(ws_base, shape, token_interval_s, f"turn{i}") for i in range(turns)
        ]
        results.append(TokenPacedResult(name, turns, tuple(times)))
    return results


def format_results(results: Sequence[TokenPacedResult], token_interval_s: float) -> str:
    lines = [
        f"first audio after the first sentence's last token ({1000 * token_interval_s:.0f} ms per token)",
        f"{'client':<20} {'turns':>5} {'median ms':>10} {'min ms':>8} {'max ms':>8}",
    ]
    for r in results:
        lines.append(
            f"{r.client:<20} {r.turns:>5} {r.median_ms:>10.0f} {min(r.first_audio_ms):>8.0f} "
            f"{max(r.first_audio_ms):>8.0f}"
        )
    return "\n".join(lines)


def run(ws_base: str, clients: Sequence[str], turns: int, token_interval_s: float) -> str:
    """Run the benchmark against `ws_base` (ws://HOST:PORT) and return the printed table."""
    unknown = [c for c in clients if c not in CLIENTS]
    if unknown:
        raise ValueError(f"unknown clients {unknown}; known: {', '.join(CLIENTS)}")
    results = asyncio.run(run_token_paced(ws_base, clients, turns, token_interval_s))
    return format_results(results, token_interval_s)
