"""HiFT vocoder: strict loading at the released layout, output contract, and streaming against offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import reference_manifest
from torch.nn.utils import parametrize

from engines.checkpoints import CheckpointError, load_strict, read_manifest_tsv
from engines.config import SAMPLES_PER_MEL_FRAME, HiFTConfig, ModelConfigs
from engines.token2wav.hift import HiFTGenerator, HiFTStream, canonical_hift_state, load_hift

MANIFEST = "cosyvoice2-0.5b.hift.pt.tsv"
TINY = ModelConfigs.tiny().hift
OVERLAP = TINY.source_cache_samples


def manifest_state(renamer=lambda name: name) -> dict[str, torch.Tensor]:
    released = read_manifest_tsv(reference_manifest(MANIFEST))
    return {renamer(name): torch.empty(shape, device="meta") for name, shape in released}


def old_weight_norm_name(name: str) -> str:
    return name.replace(".parametrizations.weight.original0", ".weight_g").replace(
        ".parametrizations.weight.original1", ".weight_v")


@pytest.fixture(scope="module")
def tiny_hift() -> HiFTGenerator:
    torch.manual_seed(0)
    return HiFTGenerator(TINY).eval()


@pytest.mark.parametrize("renamer", [
    lambda name: name,
    old_weight_norm_name,
    lambda name: "generator." + name,
    lambda name: "generator." + old_weight_norm_name(name),
], ids=["parametrizations", "weight_g_v", "generator_prefix", "prefix_and_weight_g_v"])
def test_full_config_loads_released_names_strictly(renamer) -> None:
    with torch.device("meta"):
        model = HiFTGenerator(HiFTConfig())
    state = canonical_hift_state(manifest_state(renamer))
    assert len(state) == 328
    load_strict(model, state, "manifest")


def test_full_config_rejects_a_wrong_shape() -> None:
    with torch.device("meta"):
        model = HiFTGenerator(HiFTConfig())
    state = manifest_state()
    state["conv_post.bias"] = torch.empty(17, device="meta")
    with pytest.raises(CheckpointError, match="conv_post.bias"):
        load_strict(model, state, "manifest")


@pytest.mark.parametrize("renamer", [
    lambda name: name,
    lambda name: "generator." + old_weight_norm_name(name),
], ids=["released", "old_names_with_prefix"])
def test_load_hift_reproduces_the_saved_model(tmp_path: Path, tiny_hift: HiFTGenerator, renamer) -> None:
    path = tmp_path / "hift.pt"
    torch.save({renamer(k): v for k, v in tiny_hift.state_dict().items()}, path)
    loaded = load_hift(path, TINY, "cpu")
    assert not loaded.training
    assert not any(parametrize.is_parametrized(m) for m in loaded.modules())  # weight norm folded
    mel = torch.randn(1, 80, 12)
    with torch.no_grad():
        expected, _ = tiny_hift(mel, generator=torch.Generator().manual_seed(1))
        actual, _ = loaded(mel, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_offline_shapes_and_bounds(tiny_hift: HiFTGenerator) -> None:
    frames = 23
    mel = torch.randn(2, 80, frames)
    with torch.no_grad():
        f0 = tiny_hift.f0_predictor(mel)
        speech, source = tiny_hift(mel)
    assert f0.shape == (2, frames) and bool((f0 >= 0).all())
    assert speech.shape == (2, frames * SAMPLES_PER_MEL_FRAME)
    assert source.shape == (2, 1, frames * SAMPLES_PER_MEL_FRAME)
    assert bool(torch.isfinite(speech).all()) and bool(torch.isfinite(source).all())
    assert float(speech.abs().max()) <= TINY.audio_limit
    assert float(source.abs().max()) <= 1.0  # tanh output


def test_loud_spectrum_is_clamped_to_the_audio_limit() -> None:
    torch.manual_seed(0)
    hift = HiFTGenerator(TINY).eval()
    with torch.no_grad():
        hift.conv_post.bias.fill_(6.0)  # magnitudes e^6, beyond the 100 clip
        speech, _ = hift(torch.randn(1, 80, 10))
    assert bool(torch.isfinite(speech).all())
    assert float(speech.abs().max()) == pytest.approx(TINY.audio_limit)


def test_cache_source_overwrites_the_start(tiny_hift: HiFTGenerator) -> None:
    cache = torch.full((1, 1, 2 * SAMPLES_PER_MEL_FRAME), 0.25)
    with torch.no_grad():
        _, source = tiny_hift(torch.randn(1, 80, 6), cache)
    assert bool((source[:, :, : cache.shape[-1]] == 0.25).all())
    assert not bool((source[:, :, cache.shape[-1]:] == 0.25).all())


def test_noise_follows_the_callers_generator(tiny_hift: HiFTGenerator) -> None:
    mel = torch.randn(1, 80, 8)
    with torch.no_grad():
        first, _ = tiny_hift(mel, generator=torch.Generator().manual_seed(7))
        again, _ = tiny_hift(mel, generator=torch.Generator().manual_seed(7))
        other, _ = tiny_hift(mel, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def stream_in_chunks(hift: HiFTGenerator, mel: torch.Tensor, chunks: list[int],
                     seed: int) -> list[torch.Tensor]:
    stream = HiFTStream(hift, seed=seed)
    pieces, start = [], 0
    for i, frames in enumerate(chunks):
        pieces.append(stream.process(mel[:, :, start:start + frames], last=i == len(chunks) - 1))
        start += frames
    return pieces


@pytest.mark.parametrize("f0_hz", [0.0, 150.0], ids=["unvoiced_noise", "voiced_sines"])
def test_streaming_matches_offline_outside_the_joins(f0_hz: float) -> None:
    """Same mel, same noise seed: equal length; equal away from joins; close at the joins.

    A constant pitch makes the F0 predictor blind to chunk edges, so any mismatch away from joins would
    come from the source: noise drawn out of order (unvoiced case) or sine phases restarted at a chunk
    (voiced case). Around a join J (where the previous chunk's mel ended) the output differs by
    construction in [J − 3840, J): those samples are a Hamming cross-fade of two syntheses, one without
    right context. The new call then has only the 8 cached frames of left context, which shifts samples
    up to J + 3840 by tiny amounts. Elsewhere only fp32 rounding remains: the offline sine phase grows to
    thousands of cycles (resolution ~1e-4 cycle), the streaming one is carried modulo 1.
    """
    torch.manual_seed(1)
    hift = HiFTGenerator(TINY).eval()
    with torch.no_grad():
        hift.f0_predictor.classifier.weight.zero_()
        hift.f0_predictor.classifier.bias.fill_(f0_hz)
    chunks = [40, 50, 45, 25]
    mel = torch.randn(1, 80, sum(chunks))
    with torch.no_grad():
        offline, _ = hift(mel, generator=torch.Generator().manual_seed(5))
    offline = offline[0]
    pieces = stream_in_chunks(hift, mel, chunks, seed=5)
    streamed = torch.cat(pieces)

    assert [p.numel() for p in pieces] == [40 * 480 - OVERLAP, 50 * 480, 45 * 480, 25 * 480 + OVERLAP]
    assert streamed.shape == offline.shape and streamed.dtype == torch.float32
    joins = [SAMPLES_PER_MEL_FRAME * sum(chunks[:k + 1]) for k in range(len(chunks) - 1)]
    near_join = torch.zeros_like(offline, dtype=torch.bool)
    for join in joins:
        near_join[join - OVERLAP:join + OVERLAP] = True
    torch.testing.assert_close(streamed[~near_join], offline[~near_join], atol=2e-4, rtol=0)
    difference = streamed[near_join] - offline[near_join]
    # The cross-fade blends two close syntheses: its error stays far below the signal, no click.
    assert float(difference.pow(2).mean().sqrt()) < 0.2 * float(offline[near_join].pow(2).mean().sqrt())


def test_empty_final_chunk_flushes_the_held_back_tail(tiny_hift: HiFTGenerator) -> None:
    stream = HiFTStream(tiny_hift, seed=0)
    first = stream.process(torch.randn(1, 80, 20), last=False)
    assert stream.nbytes > 0
    tail = stream.process(torch.zeros(1, 80, 0), last=True)
    assert first.numel() + tail.numel() == 20 * SAMPLES_PER_MEL_FRAME
    assert tail.numel() == OVERLAP
    with pytest.raises(RuntimeError, match="closed"):
        stream.process(torch.randn(1, 80, 10), last=True)
    assert stream.nbytes == 0


def test_short_non_final_chunk_is_rejected(tiny_hift: HiFTGenerator) -> None:
    stream = HiFTStream(tiny_hift, seed=0)
    with pytest.raises(ValueError, match="at least 8 mel frames"):
        stream.process(torch.randn(1, 80, 5), last=False)
