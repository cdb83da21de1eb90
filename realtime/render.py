"""Offline rendering of one segment (`Runtime.render`, `realtime synth`): its tokens go to token2wav in
chunks as the LLM decodes them, so token2wav works while the LLM still decodes and a long text never
needs one solve over all its frames; every chunk is due at once (no listener waits for it)."""

from __future__ import annotations

import math

import numpy as np

from engines.llm.base import TokenStream
from engines.token2wav.base import SpeakerState, Token2WavStream
from realtime.schedule import ChunkScheduler, HopPolicy
from realtime.token2wav_worker import Token2WavWorker


async def render_segment(worker: Token2WavWorker, speaker: SpeakerState, token_stream: TokenStream,
                         hops: HopPolicy) -> np.ndarray:
    """The 24 kHz audio of `token_stream`'s tokens in chunks of `hops` (the last one whatever is left);
    the token2wav stream it opens is closed however it ends."""
    schedule = ChunkScheduler(hops)
    tokens: list[int] = []
    pieces: list[np.ndarray] = []
    stream: Token2WavStream | None = None
    try:
        async for batch in token_stream:
            if stream is None:
                # Opened once decoding has begun, ~a chunk's tokens before its first chunk: the worker
                # then counts it among the streams whose first chunks are about to come and holds a call
                # for them (renders decoding together share calls), while renders still queued for an
                # LLM slot hold nothing up.
                stream = await worker.open_stream(speaker)
            tokens.extend(batch)
            pieces += await _due_chunks(worker, stream, schedule, tokens, ended=False)
        if stream is not None:
            pieces += await _due_chunks(worker, stream, schedule, tokens, ended=True)
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    finally:
        if stream is not None:
            worker.close_stream(stream)


async def _due_chunks(worker: Token2WavWorker, stream: Token2WavStream, schedule: ChunkScheduler,
                      tokens: list[int], ended: bool) -> list[np.ndarray]:
    """The audio of every chunk `schedule` has due with `tokens` (all of them once `ended`)."""
    pieces = []
    while (chunk := schedule.next_chunk(len(tokens), ended)) is not None:
        if chunk.end > chunk.start:
            piece = tokens[chunk.start : chunk.end]
            pieces.append(await worker.synthesize(stream, piece, last=chunk.last, due=-math.inf))
    return pieces


__all__ = ["render_segment"]
