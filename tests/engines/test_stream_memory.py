"""The bound on one stream's device bytes (engines/token2wav/stream_memory.py) against real streams."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engines.config import ModelConfigs
from engines.token2wav.base import ChunkJob
from engines.token2wav.dit_cache import CACHE_RULES, CacheRule, EstimatorKeys
from engines.token2wav.flow_dit import DiTFlow
from engines.token2wav.hift import HiFTGenerator
from engines.token2wav.stream_memory import most_own_frames, stream_state_bytes
from engines.token2wav.torch_backend import TorchToken2Wav
from engines.voice import VoicePrompt

MIB = 1 << 20
TINY = ModelConfigs.tiny()
LOOKAHEAD = TINY.dit_flow.encoder.pre_lookahead
RECENT = TINY.dit_flow.att_cache_recent_frames


def voice(prompt_tokens: int) -> VoicePrompt:
    generator = torch.Generator().manual_seed(prompt_tokens)
    return VoicePrompt(
        prompt_text="prompt",
        speech_tokens=torch.randint(0, 6561, (prompt_tokens,), generator=generator),
        speaker_embedding=torch.randn(192, generator=generator),
        prompt_mel=torch.randn(2 * prompt_tokens, 80, generator=generator),
    )


@pytest.mark.parametrize("rule", CACHE_RULES)
@pytest.mark.parametrize("prompt_frames", [0, 20, 100, 240])
def test_no_chunk_sequence_keeps_more_own_frames_than_the_bound(rule: CacheRule, prompt_frames: int) -> None:
    rng = random.Random(prompt_frames)
    bound = most_own_frames(rule, RECENT, prompt_frames)
    for _ in range(20):
        keys, most = EstimatorKeys.start(rule, RECENT, prompt_frames), 0
        for _ in range(30):
            keys = keys.after_chunk(2 * rng.randint(1, 200))
            most = max(most, len(keys.own))
        assert most == bound  # reached, and never passed


@pytest.mark.parametrize("rule", CACHE_RULES)
@pytest.mark.parametrize("prompt_tokens", [10, 120])  # L_p below and above R = 100 frames
def test_a_long_streams_state_reaches_the_bound(rule: CacheRule, prompt_tokens: int) -> None:
    """After enough chunks the own cache is at its most: the stream's tensors (two streams batched, as
    the server runs them) hold exactly the bound for the tokens they encoded."""
    torch.manual_seed(0)
    flow_cfg = dataclasses.replace(TINY.dit_flow, att_cache_rule=rule)
    backend = TorchToken2Wav(DiTFlow(flow_cfg), HiFTGenerator(TINY.hift), vocoder_seed=1)
    speaker = backend.prepare_speaker(voice(prompt_tokens))
    streams = [backend.open_stream(speaker) for _ in range(2)]
    tokens = torch.randint(0, 6561, (400,), generator=torch.Generator().manual_seed(5))
    start = 0
    for hop in (5, 25, 50, 100, 100, 100):
        chunk = tokens[start : start + hop + LOOKAHEAD]
        backend.run_chunks([ChunkJob(stream, chunk, last=False) for stream in streams])
        start += hop
        for stream in streams:
            assert stream.nbytes <= backend.stream_bytes_bound(speaker, start)  # type: ignore[operator]
    for stream in streams:
        assert stream.nbytes == backend.stream_bytes_bound(speaker, start)
        stream.close()


def test_the_bound_at_full_size() -> None:
    """The default voice's 4 s clip (L_p = 200 frames) over 2048 tokens, in fp16: above the 134–172 MiB
    per stream measured on an H100 under the reference rule (docs/benchmarks.md)."""
    full = ModelConfigs.full()
    u = 640 * 1024
    reference = stream_state_bytes(full.dit_flow, full.hift, 2, 200, 2048)
    assert 172 * MIB < reference < 190 * MIB
    assert reference - stream_state_bytes(full.dit_flow, full.hift, 2, 200, 0) == 2048 * 28 * 1024
    recent = dataclasses.replace(full.dit_flow, att_cache_rule="prompt_recent")
    assert reference - stream_state_bytes(recent, full.hift, 2, 200, 2048) == u * 100
