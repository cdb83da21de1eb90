"""Upsample conformer: released names at full size, relative positions, chunk mode against offline."""

from __future__ import annotations

import pytest
import torch
from reference import reference_manifest
from weights import randomize

from engines.checkpoints import load_strict, read_manifest_tsv
from engines.config import ModelConfigs
from engines.token2wav.conformer import (
    ConformerCache,
    RelativePositionTable,
    UpsampleConformerEncoder,
    blocks_attention_mask,
    chunk_attention_mask,
    rel_shift,
)

TINY = ModelConfigs.tiny().dit_flow.encoder
LOOKAHEAD = TINY.pre_lookahead



@pytest.fixture(scope="module")
def encoder() -> UpsampleConformerEncoder:
    enc = UpsampleConformerEncoder(TINY).eval()
    randomize(enc, seed=0)
    return enc


FLOW_MANIFESTS = ["step-audio-2-mini.token2wav.flow.pt.tsv", "cosyvoice2-0.5b.flow.pt.tsv"]


@pytest.mark.parametrize("manifest", FLOW_MANIFESTS)
def test_full_config_matches_both_released_encoders(manifest: str) -> None:
    released = read_manifest_tsv(reference_manifest(manifest))
    entries = [(name.removeprefix("encoder."), shape) for name, shape in released if name[:8] == "encoder."]
    with torch.device("meta"):
        enc = UpsampleConformerEncoder(ModelConfigs.full().dit_flow.encoder)
    state = enc.state_dict()
    assert [(name, tuple(t.shape)) for name, t in state.items()] == entries
    load_strict(enc, {name: torch.empty(shape, device="meta") for name, shape in entries}, manifest)


def test_rel_shift_maps_columns_to_distances() -> None:
    rows, keys = 3, 7
    scores = torch.randn(2, rows, 2 * keys - 1)
    shifted = rel_shift(scores)
    assert shifted.shape == (2, rows, keys)
    for i in range(rows):
        for j in range(keys):
            distance = (keys - rows + i) - j  # query i is absolute frame keys - rows + i
            assert torch.equal(shifted[:, i, j], scores[:, i, keys - 1 - distance])


def test_position_table_is_centred_and_bounded() -> None:
    table = RelativePositionTable(8, max_len=10)
    middle = table(4)
    assert middle.shape == (7, 8)
    torch.testing.assert_close(middle[3], torch.tensor([0.0, 1.0] * 4))  # distance 0: sin 0, cos 0
    with pytest.raises(ValueError, match="exceeds the position table"):
        table(11)


def test_masks() -> None:
    assert chunk_attention_mask(5, 2).int().tolist() == [
        [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert torch.equal(blocks_attention_mask([2, 2, 1]), chunk_attention_mask(5, 2))


def run_chunks(encoder: UpsampleConformerEncoder, xs: torch.Tensor, hops: list[int]) -> tuple[
        torch.Tensor, ConformerCache]:
    """Chunk mode over xs: hops[k] new tokens (+ lookahead) per chunk, the rest in the last one."""
    cache = ConformerCache.empty(TINY, xs.shape[0], xs.device, xs.dtype)
    outputs, start = [], 0
    for hop in hops:
        out, update = encoder.forward_chunk(xs[:, start:start + hop + LOOKAHEAD], cache, last=False)
        assert out.shape[1] == TINY.up_stride * hop
        cache = cache.extend(update)
        outputs.append(out)
        start += hop
    out, update = encoder.forward_chunk(xs[:, start:], cache, last=True)
    outputs.append(out)
    return torch.cat(outputs, dim=1), cache.extend(update)


@pytest.mark.parametrize("hops", [[7, 5], [1, 1, 9], [13]])
def test_chunk_mode_equals_block_causal_offline(encoder: UpsampleConformerEncoder, hops: list[int]) -> None:
    n = 20
    xs = torch.randn(2, n, TINY.d_model)
    with torch.no_grad():
        streamed, cache = run_chunks(encoder, xs, hops)
        mask = blocks_attention_mask([*hops, n - sum(hops)])
        offline, lengths = encoder(xs, torch.tensor([n, n]), mask)
        unmasked, _ = encoder(xs, torch.tensor([n, n]))
    assert lengths.tolist() == [2 * n, 2 * n]
    assert cache.num_tokens == n and cache.frame_kv.shape[3] == 2 * n
    # Only fp32 reassociation differs (rectangular vs square matmuls).
    torch.testing.assert_close(streamed, offline, atol=1e-5, rtol=1e-5)
    # The mask matters: earlier chunks never see later tokens in chunk mode.
    assert (streamed[:, : 2 * hops[0]] - unmasked[:, : 2 * hops[0]]).abs().max() > 1e-3


def test_padding_does_not_change_the_valid_frames(encoder: UpsampleConformerEncoder) -> None:
    short = torch.randn(1, 9, TINY.d_model)
    padded = torch.cat([short, torch.randn(1, 4, TINY.d_model)], dim=1)
    with torch.no_grad():
        alone, _ = encoder(short, torch.tensor([9]))
        batch = torch.cat([padded, torch.randn(1, 13, TINY.d_model)])
        batched, lengths = encoder(batch, torch.tensor([9, 13]))
    assert lengths.tolist() == [18, 26]
    torch.testing.assert_close(batched[:1, :18], alone, atol=1e-5, rtol=1e-5)


def test_context_is_right_padding_only(encoder: UpsampleConformerEncoder) -> None:
    """CosyVoice2 streaming: context tokens feed PreLookahead, never attention, and yield no frames."""
    n = 10
    xs = torch.randn(1, n + LOOKAHEAD, TINY.d_model)
    hide_context = torch.ones(n + LOOKAHEAD, n + LOOKAHEAD, dtype=torch.bool)
    hide_context[:, n:] = False
    with torch.no_grad():
        with_context, _ = encoder(xs[:, :n], torch.tensor([n]), context=xs[:, n:])
        reference, _ = encoder(xs, torch.tensor([n + LOOKAHEAD]), hide_context)
        zero_padded, _ = encoder(xs[:, :n], torch.tensor([n]))
    assert with_context.shape == (1, 2 * n, TINY.d_model)
    torch.testing.assert_close(with_context, reference[:, : 2 * n], atol=1e-5, rtol=1e-5)
    assert (with_context - zero_padded).abs().max() > 1e-3


def test_static_chunk_mask_hides_future_chunks(encoder: UpsampleConformerEncoder) -> None:
    chunk = 4
    xs = torch.randn(1, 12, TINY.d_model)
    changed = xs.clone()
    changed[:, chunk + LOOKAHEAD:] += 1.0  # beyond the first chunk and its lookahead
    mask = chunk_attention_mask(12, chunk)
    with torch.no_grad():
        before, _ = encoder(xs, torch.tensor([12]), mask)
        after, _ = encoder(changed, torch.tensor([12]), mask)
    torch.testing.assert_close(after[:, : 2 * chunk], before[:, : 2 * chunk])
    assert (after[:, 2 * chunk:] - before[:, 2 * chunk:]).abs().max() > 1e-3
