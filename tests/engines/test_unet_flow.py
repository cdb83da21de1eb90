"""CosyVoice2 UNet flow: strict loading at the released layout, estimator masks, streaming vs offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import reference_manifest

from engines.checkpoints import load_strict, read_manifest_tsv
from engines.config import MEL_BINS, PRE_LOOKAHEAD, FlowConfig, ModelConfigs
from engines.token2wav.flow_unet import UNetFlow, load_unet_flow
from engines.token2wav.unet import CausalConditionalDecoder, streaming_mask
from engines.voice import VoicePrompt

MANIFEST = "cosyvoice2-0.5b.flow.pt.tsv"
TINY = ModelConfigs.tiny().unet_flow
PROMPT_TOKENS = 5
GRID = TINY.encoder.static_chunk_size  # 25 tokens = 50 mel frames


@pytest.fixture(scope="module")
def flow() -> UNetFlow:
    torch.manual_seed(0)
    return UNetFlow(TINY).eval()


@pytest.fixture(scope="module")
def voice() -> VoicePrompt:
    g = torch.Generator().manual_seed(1)
    return VoicePrompt(
        prompt_text="prompt",
        speech_tokens=torch.randint(0, 6561, (PROMPT_TOKENS,), generator=g),
        speaker_embedding=torch.randn(192, generator=g),
        prompt_mel=torch.randn(2 * PROMPT_TOKENS, MEL_BINS, generator=g),
    )


def test_full_config_loads_the_released_flow_strictly() -> None:
    manifest = read_manifest_tsv(reference_manifest(MANIFEST))
    with torch.device("meta"):
        model = UNetFlow(FlowConfig(estimator_kind="unet"))
    load_strict(model, {name: torch.empty(shape, device="meta") for name, shape in manifest}, "manifest")
    assert list(model.state_dict()) == [name for name, _ in manifest]  # same order as the file


def test_load_unet_flow_round_trip(tmp_path: Path, flow: UNetFlow) -> None:
    path = tmp_path / "flow.pt"
    torch.save(flow.state_dict(), path)
    loaded = load_unet_flow(path, TINY, "cpu", torch.float32)
    assert not loaded.training
    for (name, expected), actual in zip(flow.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), name


def test_unet_flow_rejects_the_dit_config() -> None:
    with pytest.raises(ValueError, match="unet"):
        UNetFlow(ModelConfigs.tiny().dit_flow)


def estimator_inputs(frames: int, batch: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    x, mu, cond = (torch.randn(batch, MEL_BINS, frames, generator=g) for _ in range(3))
    return x, mu, torch.rand(batch, generator=g), torch.randn(batch, MEL_BINS, generator=g), cond


@torch.inference_mode()
def test_streaming_attention_hides_later_chunks_only(flow: UNetFlow) -> None:
    estimator = flow.decoder.estimator
    assert isinstance(estimator, CausalConditionalDecoder)
    x, mu, t, spks, cond = estimator_inputs(120)
    later = x.clone()
    later[:, :, 60:] += 1.0  # frames in the second 50-frame chunk and beyond
    chunked = streaming_mask(TINY.unet, 120)
    full = torch.ones(2, 1, 120, dtype=torch.bool)
    v, v_later = (estimator(inp, chunked, mu, t, spks, cond) for inp in (x, later))
    assert v.shape == (2, MEL_BINS, 120)
    assert torch.equal(v[:, :, :50], v_later[:, :, :50])  # causal convs + chunk mask
    assert not torch.allclose(v[:, :, 50:60], v_later[:, :, 50:60])  # same chunk: visible
    v_full, v_full_later = (estimator(inp, full, mu, t, spks, cond) for inp in (x, later))
    assert not torch.allclose(v_full[:, :, :50], v_full_later[:, :, :50])  # full attention sees ahead


@torch.inference_mode()
def test_padded_frames_do_not_change_valid_ones(flow: UNetFlow) -> None:
    estimator = flow.decoder.estimator
    x, mu, t, spks, cond = estimator_inputs(40, batch=1)
    valid = torch.ones(1, 1, 40, dtype=torch.bool)
    padded_mask = torch.cat([valid, torch.zeros(1, 1, 9, dtype=torch.bool)], dim=2)
    pad = torch.randn(1, MEL_BINS, 9)
    v = estimator(x, valid, mu, t, spks, cond)
    v_padded = estimator(torch.cat([x, pad], 2), padded_mask, torch.cat([mu, pad], 2), t, spks,
                         torch.cat([cond, pad], 2))
    torch.testing.assert_close(v_padded[:, :, :40], v, atol=1e-5, rtol=1e-5)
    assert bool((v_padded[:, :, 40:] == 0).all())


def run_stream(
    flow: UNetFlow, voice: VoicePrompt, tokens: torch.Tensor, hops: list[int]
) -> list[torch.Tensor]:
    """The chunk protocol: [offset, offset + hop + 3) per non-final chunk, then everything left."""
    stream = flow.open_stream(flow.prepare_speaker(voice))
    pieces, offset = [], 0
    for hop in hops:
        pieces.append(flow.chunk(stream, tokens[offset:offset + hop + PRE_LOOKAHEAD], last=False))
        offset += hop
    pieces.append(flow.chunk(stream, tokens[offset:], last=True))
    assert stream.nbytes == tokens.numel() * tokens.element_size()
    stream.close()
    assert stream.nbytes == 0
    return pieces


def test_streaming_on_the_chunk_grid_equals_offline(flow: UNetFlow, voice: VoicePrompt) -> None:
    """What equals what. Non-final calls run the encoder and estimator with static-chunk attention on
    prompt + tokens so far (3 lookahead tokens as right context), so when each call ends on the
    25-token grid (counted from the prompt's first token; hops as the reference's §6.4: 25 + prompt
    padding, then multiples of 25) their new frames equal the same frames of one chunk-masked pass over
    the whole utterance (`offline(chunked=True)`): causal convs, same chunks, same per-frame noise. The
    final call, like the reference's, recomputes everything with full attention, so its frames equal
    plain `offline()`'s."""
    hops = [GRID - PROMPT_TOKENS, GRID]
    tokens = torch.randint(0, 6561, (sum(hops) + 9,), generator=torch.Generator().manual_seed(3))
    pieces = run_stream(flow, voice, tokens, hops)
    speaker = flow.prepare_speaker(voice)
    chunked = flow.offline(speaker, tokens, chunked=True)
    full = flow.offline(speaker, tokens)

    assert [p.shape[2] for p in pieces] == [2 * hops[0], 2 * hops[1], 2 * 9]
    assert chunked.shape == full.shape == (1, MEL_BINS, 2 * tokens.numel())
    split = 2 * sum(hops)
    torch.testing.assert_close(torch.cat(pieces[:-1], dim=2), chunked[:, :, :split], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pieces[-1], full[:, :, split:], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(chunked, full, atol=1e-3)  # the two attention modes do differ


def test_off_grid_hops_give_two_frames_per_token(flow: UNetFlow, voice: VoicePrompt) -> None:
    hops = [7, 11]
    tokens = torch.randint(0, 6561, (sum(hops) + 5,), generator=torch.Generator().manual_seed(4))
    pieces = run_stream(flow, voice, tokens, hops)
    assert [p.shape[2] for p in pieces] == [14, 22, 10]
    assert all(bool(torch.isfinite(p).all()) and p.dtype == torch.float32 for p in pieces)


def test_non_final_chunk_needs_more_than_the_lookahead(flow: UNetFlow, voice: VoicePrompt) -> None:
    stream = flow.open_stream(flow.prepare_speaker(voice))
    with pytest.raises(ValueError, match="more than 3"):
        flow.chunk(stream, torch.arange(PRE_LOOKAHEAD), last=False)
