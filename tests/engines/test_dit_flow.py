"""Step-Audio2 DiT flow: strict loading, cached estimator steps, streaming against offline, bounded caches."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from reference import reference_manifest
from weights import randomize

from engines.checkpoints import CheckpointError, load_strict, read_manifest_tsv
from engines.config import FlowConfig, ModelConfigs
from engines.token2wav.cfm import ConditionalCFM, cosine_time_grid
from engines.token2wav.conformer import blocks_attention_mask
from engines.token2wav.dit import DiT
from engines.token2wav.flow_dit import DiTFlow, DiTStream, load_dit_flow
from engines.voice import VoicePrompt

MANIFEST = "step-audio-2-mini.token2wav.flow.pt.tsv"
TINY = ModelConfigs.tiny().dit_flow
LOOKAHEAD = TINY.encoder.pre_lookahead
PROMPT_TOKENS = 12



def tiny_flow(cfg: FlowConfig = TINY) -> DiTFlow:
    flow = DiTFlow(cfg).eval()
    randomize(flow, seed=0)
    return flow


@pytest.fixture(scope="module")
def flow() -> DiTFlow:
    return tiny_flow()


@pytest.fixture(scope="module")
def voice() -> VoicePrompt:
    generator = torch.Generator().manual_seed(1)
    return VoicePrompt(
        prompt_text="prompt",
        speech_tokens=torch.randint(0, TINY.vocab_size, (PROMPT_TOKENS,), generator=generator),
        speaker_embedding=torch.randn(192, generator=generator),
        prompt_mel=torch.randn(2 * PROMPT_TOKENS, 80, generator=generator),
    )


def utterance(voice: VoicePrompt, length: int, seed: int) -> torch.Tensor:
    """Tokens that start like the prompt: streaming's stand-in prompt lookahead (the prompt's first 3
    tokens) then equals the real one, so streaming and block-causal offline compute the same thing."""
    generator = torch.Generator().manual_seed(seed)
    rest = torch.randint(0, TINY.vocab_size, (length - LOOKAHEAD,), generator=generator)
    return torch.cat([voice.speech_tokens[:LOOKAHEAD], rest])


def stream_mel(flow: DiTFlow, stream: DiTStream, tokens: torch.Tensor, hops: list[int]) -> list[torch.Tensor]:
    """The chunk protocol: hop new tokens + 3 lookahead per chunk, then everything left."""
    mels, start = [], 0
    for hop in hops:
        mels.append(flow.chunk(stream, tokens[start:start + hop + LOOKAHEAD], last=False))
        start += hop
    mels.append(flow.chunk(stream, tokens[start:], last=True))
    return mels


# -- loading ------------------------------------------------------------------------------------------------


def test_full_config_state_dict_is_the_released_layout() -> None:
    entries = read_manifest_tsv(reference_manifest(MANIFEST))
    with torch.device("meta"):
        full = DiTFlow(ModelConfigs.full().dit_flow)
    assert [(name, tuple(t.shape)) for name, t in full.state_dict().items()] == entries
    load_strict(full, {name: torch.empty(shape, device="meta") for name, shape in entries}, "manifest")


def test_mismatched_checkpoint_is_rejected_by_name() -> None:
    entries = dict(read_manifest_tsv(reference_manifest(MANIFEST)))
    entries.pop("decoder.estimator.blocks.3.attn.q_norm.weight")
    entries["encoder_proj.weight"] = (80, 256)
    with torch.device("meta"):
        full = DiTFlow(ModelConfigs.full().dit_flow)
    state = {name: torch.empty(shape, device="meta") for name, shape in entries.items()}
    with pytest.raises(CheckpointError, match=r"blocks\.3\.attn\.q_norm\.weight") as error:
        load_strict(full, state, "flow.pt")
    assert "encoder_proj.weight: expected [80, 512], found [80, 256]" in str(error.value)


def test_load_dit_flow_round_trip(tmp_path: Path, flow: DiTFlow, voice: VoicePrompt) -> None:
    path = tmp_path / "flow.pt"
    torch.save(flow.state_dict(), path)
    loaded = load_dit_flow(path, TINY, "cpu", torch.float32)
    assert not loaded.training
    tokens = utterance(voice, 10, seed=2)
    torch.testing.assert_close(loaded.offline(loaded.prepare_speaker(voice), tokens),
                               flow.offline(flow.prepare_speaker(voice), tokens))
    with pytest.raises(ValueError, match="estimator_kind"):
        DiTFlow(dataclasses.replace(TINY, estimator_kind="unet"))


# -- estimator and solver ---------------------------------------------------------------------------------


def test_cached_steps_equal_the_uncached_forward() -> None:
    cfg = TINY.dit
    dit = DiT(cfg).eval()
    randomize(dit, seed=3)
    b, chunks = 2, [9, 1, 6]
    total = sum(chunks)
    x, mu, cond = (torch.randn(b, 80, total) for _ in range(3))
    spks, t = torch.randn(b, 80), torch.rand(b)
    cnn = torch.zeros(cfg.depth, b, 2 * cfg.hidden_size, 2)
    kv = torch.zeros(cfg.depth, b, cfg.num_heads, 0, 2 * cfg.head_dim)
    pieces, start = [], 0
    with torch.no_grad():
        for size in chunks:
            window = slice(start, start + size)
            v, cnn, new_kv = dit.forward_chunk(
                x[..., window], mu[..., window], t, spks, cond[..., window], cnn, kv)
            assert new_kv.shape == (cfg.depth, b, cfg.num_heads, size, 2 * cfg.head_dim)
            kv = torch.cat([kv, new_kv], dim=3)
            pieces.append(v)
            start += size
        block_causal = blocks_attention_mask(chunks)[None].expand(b, -1, -1)
        expected = dit(x, block_causal, mu, t, spks, cond)
        full = dit(x, torch.ones(b, 1, total, dtype=torch.bool), mu, t, spks, cond)
    assert cnn.shape == (cfg.depth, b, 2 * cfg.hidden_size, 2)
    torch.testing.assert_close(torch.cat(pieces, dim=2), expected, atol=1e-5, rtol=1e-5)
    # Without the block-causal mask, earlier frames would see later ones.
    assert (full[..., : chunks[0]] - pieces[0]).abs().max() > 1e-3


def test_cache_order_does_not_matter() -> None:
    """No positions in the DiT: the caller may keep shared prompt frames first and trim anywhere."""
    cfg = TINY.dit
    dit = DiT(cfg).eval()
    randomize(dit, seed=4)
    x, mu, cond = (torch.randn(1, 80, 5) for _ in range(3))
    spks, t = torch.randn(1, 80), torch.rand(1)
    cnn = torch.randn(cfg.depth, 1, 2 * cfg.hidden_size, 2)
    kv = torch.randn(cfg.depth, 1, cfg.num_heads, 7, 2 * cfg.head_dim)
    with torch.no_grad():
        v, _, _ = dit.forward_chunk(x, mu, t, spks, cond, cnn, kv)
        shuffled, _, _ = dit.forward_chunk(x, mu, t, spks, cond, cnn, kv[:, :, :, torch.randperm(7)])
    torch.testing.assert_close(v, shuffled, atol=1e-5, rtol=1e-5)


def test_time_grid_and_seeded_noise() -> None:
    grid = cosine_time_grid(10)
    assert grid[0] == 0.0 and grid[-1] == pytest.approx(1.0)
    assert grid[1] == pytest.approx(1 - math.cos(math.pi / 20))
    assert all(b - a < d - c for a, b, c, d in zip(grid, grid[1:], grid[1:], grid[2:], strict=False))
    first = ConditionalCFM(torch.nn.Identity(), 10, 0.7, noise_frames=50, seed=0)
    second = ConditionalCFM(torch.nn.Identity(), 10, 0.7, noise_frames=50, seed=0)
    assert torch.equal(first.noise, second.noise)
    wrapped = torch.cat([first.noise[:, :, 45:], first.noise[:, :, :5]], dim=2)
    assert torch.equal(first.noise_at(45, 10), wrapped)
    with pytest.raises(TypeError, match="no cached chunk mode"):
        first.solve_chunk(torch.zeros(1, 80, 2), torch.zeros(1, 80), torch.zeros(1, 80, 2), 0,
                          torch.zeros(10), None, torch.zeros(10))


# -- streaming ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hops", [[15, 25], [4, 4, 4], []], ids=["15+25", "equal_4", "single_chunk"])
def test_streaming_equals_block_causal_offline(flow: DiTFlow, voice: VoicePrompt, hops: list[int]) -> None:
    """Same model, same noise columns, same attention pattern → the same mel up to fp32 rounding.

    Plain `offline` lets every frame attend to later chunks too, which the causal streaming model
    cannot see; with chunk_layout it restricts attention to what each chunk saw. The remaining
    differences are reassociation in rectangular vs square matmuls over 10 Euler steps (~1e-6).
    """
    tokens = utterance(voice, 47, seed=5)
    speaker = flow.prepare_speaker(voice)
    stream = flow.open_stream(speaker)
    mels = stream_mel(flow, stream, tokens, hops)
    assert [m.shape[2] for m in mels] == [2 * h for h in hops] + [2 * (tokens.numel() - sum(hops))]
    streamed = torch.cat(mels, dim=2)
    offline = flow.offline(speaker, tokens, chunk_layout=[*hops, tokens.numel() - sum(hops)])
    assert offline.shape == (1, 80, 2 * tokens.numel())
    torch.testing.assert_close(streamed, offline, atol=1e-4, rtol=1e-4)
    if hops:
        full = flow.offline(speaker, tokens)
        assert (full[..., : 2 * hops[0]] - streamed[..., : 2 * hops[0]]).abs().max() > 1e-4


def test_streams_share_the_prompt_state_without_copying(flow: DiTFlow, voice: VoicePrompt) -> None:
    speaker = flow.prepare_speaker(voice)
    prompt_kv = speaker.estimator_kv.clone()
    assert speaker.estimator_kv.shape[4] == 2 * PROMPT_TOKENS
    first, second = flow.open_stream(speaker), flow.open_stream(speaker)
    assert first.nbytes < speaker.nbytes / 4  # own caches only
    tokens = utterance(voice, 20, seed=6)
    a = flow.chunk(first, tokens[:13], last=False)
    b = flow.chunk(second, tokens[:13], last=False)
    torch.testing.assert_close(a, b)
    assert first.estimator_kv.shape[4] == 20 and first.encoder.num_tokens == 10
    assert torch.equal(speaker.estimator_kv, prompt_kv)
    first.close()
    first.close()
    assert first.nbytes == 0
    with pytest.raises(ValueError, match="open DiTStream"):
        flow.chunk(first, tokens[10:], last=True)
    assert flow.chunk(second, tokens[10:], last=True).shape == (1, 80, 20)


def test_chunk_protocol_errors_and_empty_final_chunk(flow: DiTFlow, voice: VoicePrompt) -> None:
    stream = flow.open_stream(flow.prepare_speaker(voice))
    with pytest.raises(ValueError, match="more than 3 tokens"):
        flow.chunk(stream, torch.tensor([1, 2, 3]), last=False)
    assert flow.chunk(stream, torch.zeros(0, dtype=torch.long), last=True).shape == (1, 80, 0)


def test_trimming_bounds_the_caches_and_starts_only_when_needed(voice: VoicePrompt) -> None:
    recent_frames, table = 24, 80  # history ≤ 40 frames = 20 tokens: the prompt's 12 + 8 of the stream
    kept_tokens = table // 4 - PROMPT_TOKENS
    cfg = dataclasses.replace(
        TINY, att_cache_recent_frames=recent_frames,
        encoder=dataclasses.replace(TINY.encoder, max_relative_len=table))
    untrimmed_cfg = dataclasses.replace(
        TINY, att_cache_recent_frames=10_000,
        encoder=dataclasses.replace(TINY.encoder, max_relative_len=1000))
    trimmed, untrimmed = tiny_flow(cfg), tiny_flow(untrimmed_cfg)
    hop, chunks = 5, 12
    tokens = utterance(voice, hop * chunks + LOOKAHEAD, seed=7)
    streams = [flow.open_stream(flow.prepare_speaker(voice)) for flow in (trimmed, untrimmed)]
    sizes = []
    for k in range(chunks):
        piece = tokens[k * hop: (k + 1) * hop + LOOKAHEAD]
        mels = [flow.chunk(stream, piece, last=False) for flow, stream in zip((trimmed, untrimmed), streams,
                                                                             strict=True)]
        trimmed_stream = streams[0]
        assert trimmed_stream.estimator_kv.shape[4] == min(2 * hop * (k + 1), recent_frames)
        assert trimmed_stream.encoder.num_tokens == min(hop * (k + 1), kept_tokens)
        assert torch.isfinite(mels[0]).all()
        if 2 * hop * k <= recent_frames and hop * k <= kept_tokens:  # nothing dropped before this chunk
            torch.testing.assert_close(mels[0], mels[1], atol=1e-4, rtol=1e-4)
        sizes.append(trimmed_stream.nbytes)
    assert sizes[-1] == sizes[-2] == sizes[-3]
    assert streams[0].frames == 2 * hop * chunks


def test_bfloat16_flow_tracks_float32(flow: DiTFlow, voice: VoicePrompt) -> None:
    """Half precision as deployed: time features stay fp32 inside, so only bf16 rounding (2⁻⁸ relative
    per op) separates the two; over 10 Euler steps it stays within a few hundredths of mel values ~5."""
    half = tiny_flow().to(torch.bfloat16)
    tokens = utterance(voice, 20, seed=8)
    mels = []
    for model in (flow, half):
        stream = model.open_stream(model.prepare_speaker(voice))
        mels.append(torch.cat(stream_mel(model, stream, tokens, [10]), dim=2))
    assert mels[1].dtype == torch.bfloat16
    torch.testing.assert_close(mels[1].float(), mels[0], atol=0.15, rtol=0.02)
