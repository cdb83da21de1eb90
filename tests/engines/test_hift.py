"""HiFT vocoder: strict loading at the released layout, output contract, and streaming against offline."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference import reference_manifest
from torch.nn.utils import parametrize
from weights import randomize

from engines.checkpoints import CheckpointError, load_strict, read_manifest_tsv
from engines.config import SAMPLES_PER_MEL_FRAME, HiFTConfig, ModelConfigs
from engines.token2wav.hift import HiFTGenerator, canonical_hift_state, load_hift
from engines.token2wav.hift_stream import HiFTStream, vocode_streams
from engines.token2wav.vocoder_graphs import FinalChunkBuckets, GraphedVocoder, VocodeShape

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


def voiced_hift(seed: int) -> HiFTGenerator:
    """A tiny HiFT whose F0 varies around 150 Hz with the mel (every frame voiced)."""
    torch.manual_seed(seed)
    hift = HiFTGenerator(TINY).eval()
    with torch.no_grad():
        hift.f0_predictor.classifier.weight.mul_(1500.0)
        hift.f0_predictor.classifier.bias.fill_(150.0)
    return hift


def test_unvoiced_streaming_matches_offline_outside_the_joins() -> None:
    """Same mel, same noise seed: equal length; equal away from joins; close at the joins.

    Unvoiced frames (F0 = 0) carry noise only, so any mismatch away from joins would come from noise
    drawn out of order. Around a join J (where the previous chunk's mel ended) the output differs by
    construction in [J − 3840, J): those samples are a Hamming cross-fade of two syntheses, one without
    right context. The new call then has only the 8 cached frames of left context, which shifts samples
    up to J + 3840 by tiny amounts. Elsewhere only fp32 rounding remains.
    """
    torch.manual_seed(1)
    hift = HiFTGenerator(TINY).eval()
    with torch.no_grad():
        hift.f0_predictor.classifier.weight.zero_()
        hift.f0_predictor.classifier.bias.zero_()
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


def reference_source(hift: HiFTGenerator, mel: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """CosyVoice2's SineGen2 + source module at 24 kHz, from its definition (MODEL_FACTS §7.3): F0
    upsampled ×480 (nearest), per-sample phase increments (f0·h / sr) mod 1 with a random start phase on
    sample 0 for the overtones, linear downsampling ×1/480, cumulative sum, ×480 and linear upsampling
    back, 0.1·sin; voiced where F0 > 10 Hz; noise 0.003 (voiced) or 0.1/3 (unvoiced); Linear + tanh."""
    cfg, hop = hift.cfg, hift.hop_samples
    f0 = hift.f0_predictor(mel)  # (1, T)
    f0_samples = f0.repeat_interleave(hop, dim=1).unsqueeze(-1)  # (1, L, 1)
    harmonics = f0_samples * torch.arange(1, cfg.nb_harmonics + 2, dtype=torch.float32)
    rad = (harmonics / cfg.sampling_rate) % 1
    start = torch.rand(1, cfg.nb_harmonics + 1)
    start[:, 0] = 0
    rad[:, 0, :] = rad[:, 0, :] + start
    rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / hop, mode="linear").transpose(1, 2)
    phase = torch.cumsum(rad, dim=1) * 2 * math.pi
    phase = F.interpolate(phase.transpose(1, 2) * hop, scale_factor=hop, mode="linear").transpose(1, 2)
    sines = cfg.nsf_alpha * torch.sin(phase)
    uv = (f0_samples > cfg.nsf_voiced_threshold).float()
    excitation = sines * uv + (uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3) * noise
    return torch.tanh(hift.m_source.l_linear(excitation)).transpose(1, 2)


def reference_streaming(hift: HiFTGenerator, mel: torch.Tensor, chunks: list[int],
                        seed: int) -> list[torch.Tensor]:
    """Step-Audio2's / CosyVoice2's HiFT streaming (MODEL_FACTS §5.6), from its definition: each call
    vocodes [8 cached mel frames, chunk] with its phases from zero, overwrites the first 3840 source
    samples with the cached source, cross-fades 3840 samples with np.hamming(7680) halves, caches the
    last 8 frames / 3840 source and speech samples, and holds those speech samples back unless last.
    The noise comes from one generator, drawn for the samples after the cache (the cached ones are
    overwritten anyway), as HiFTStream draws it."""
    generator = torch.Generator().manual_seed(seed)
    window = torch.from_numpy(np.hamming(2 * OVERLAP)).float()
    cache_mel, cache_source, cache_speech = torch.zeros(1, 80, 0), torch.zeros(1, 1, 0), torch.zeros(1, 0)
    pieces, start = [], 0
    for i, frames in enumerate(chunks):
        last = i == len(chunks) - 1
        mel_in = torch.cat([cache_mel, mel[:, :, start:start + frames]], dim=2)
        start += frames
        samples = mel_in.shape[2] * hift.hop_samples
        drawn = torch.randn((samples - cache_source.shape[2], TINY.nb_harmonics + 1), generator=generator)
        noise = torch.cat([torch.zeros(cache_source.shape[2], TINY.nb_harmonics + 1), drawn])[None]
        source = reference_source(hift, mel_in, noise)
        source[:, :, :cache_source.shape[2]] = cache_source
        speech = hift.decode(mel_in, source)
        if cache_speech.shape[1]:
            speech = speech.clone()
            speech[:, :OVERLAP] = speech[:, :OVERLAP] * window[:OVERLAP] + cache_speech * window[OVERLAP:]
        cache_mel, cache_source = mel_in[:, :, -8:], source[:, :, -OVERLAP:]
        cache_speech = speech[:, -OVERLAP:]
        pieces.append(speech[0] if last else speech[0, :-OVERLAP])
    return pieces


def test_voiced_streaming_equals_the_reference_streaming() -> None:
    """On voiced frames of varying pitch: ours == the reference's streaming (phases restarted at every
    call), and — what that streaming keeps of offline — the first chunk's emitted samples away from its
    end equal offline output; later chunks, whose sines restart, do not.

    Tolerance: the phases reach ~10³ cycles, where fp32 resolves ~1e-4 cycle; ours accumulates them per
    frame, the reference per sample before interpolating (measured: 1.6e-5 at most on output ~0.1)."""
    hift = voiced_hift(seed=2)
    chunks = [30, 50, 60, 24]
    mel = torch.randn(1, 80, sum(chunks), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        f0 = hift.f0_predictor(mel)
        want = reference_streaming(hift, mel, chunks, seed=9)
        offline, _ = hift(mel, generator=torch.Generator().manual_seed(9))
    assert float((f0 > 80).float().mean()) > 0.9 and float(f0.std()) > 5  # voiced, pitch moving
    got = stream_in_chunks(hift, mel, chunks, seed=9)
    assert [g.numel() for g in got] == [w.numel() for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    first_end = chunks[0] * SAMPLES_PER_MEL_FRAME - 2 * OVERLAP
    torch.testing.assert_close(got[0][:first_end], offline[0, :first_end], atol=1e-4, rtol=0)
    hop = SAMPLES_PER_MEL_FRAME
    second = slice(chunks[0] * hop + OVERLAP, sum(chunks[:2]) * hop - OVERLAP)
    assert float((torch.cat(got)[second] - offline[0, second]).abs().max()) > 5e-3


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


# Padded and unpadded calls are equal in exact arithmetic, but kernels chosen by shape sum in other
# orders, and these weights amplify the source's rounding ~200× (float32: up to ~1e-2 on outputs ~0.5,
# a padded row's and an unpadded one's alike). In float64 that is ~1e-11; a padding error is ~1e-2.
FLOAT64_ATOL = 1e-9
FLOAT32_ULP = 6e-8  # of samples within ±1: a float64 difference far below it may still round apart


def randomized_voiced_hift(seed: int) -> HiFTGenerator:
    """A tiny HiFT with no zero or unit parameter (biases and Snake α random too) whose F0 varies around
    150 Hz with the mel (a few frames unvoiced), in float64: what masked padding must get right and
    synthetic weights (zero biases, unvoiced F0) would not show."""
    torch.manual_seed(seed)
    hift = HiFTGenerator(TINY).eval().double()
    randomize(hift, seed)
    with torch.no_grad():
        for name, p in hift.named_parameters():
            if name.endswith("alpha"):
                p.copy_(0.5 + p.abs())
        hift.f0_predictor.classifier.weight.mul_(300.0)
        hift.f0_predictor.classifier.bias.fill_(150.0)
    return hift


@pytest.mark.parametrize("cached_frames", [0, TINY.mel_cache_frames])
def test_right_padded_rows_equal_each_row_alone(cached_frames: int) -> None:
    """A batch of rows right-padded (with garbage) to one length, given each row's frames: each row's
    speech and source equal the row vocoded alone at its own length, and are zero after it."""
    hift = randomized_voiced_hift(seed=4)
    hop = SAMPLES_PER_MEL_FRAME
    lengths = [cached_frames + 2, cached_frames + 13, 40, cached_frames + 27]
    padded_frames = 40
    generator = torch.Generator().manual_seed(5)
    f64 = torch.float64
    mels = [torch.randn(1, 80, n, generator=generator, dtype=f64) for n in lengths]
    caches = [torch.randn(1, 1, cached_frames * hop, generator=generator, dtype=f64).tanh() for _ in lengths]
    noises = [torch.randn(1, (n - cached_frames) * hop, hift.num_harmonics, generator=generator, dtype=f64)
              for n in lengths]
    pad = padded_frames - torch.tensor(lengths)
    mel = torch.cat([torch.cat([m, 5 * torch.randn(1, 80, int(p), generator=generator, dtype=f64)], 2)
                     for m, p in zip(mels, pad, strict=True)])
    noise = torch.cat([torch.cat([z, torch.randn(1, int(p) * hop, z.shape[2], generator=generator,
                                                 dtype=f64)], 1)
                       for z, p in zip(noises, pad, strict=True)])
    with torch.no_grad():
        f0 = hift.f0_predictor(mel)
        out = hift.vocode_with_noise(mel, torch.cat(caches) if cached_frames else None, noise,
                                     torch.tensor(lengths))
        alone = [hift.vocode_with_noise(m, c if cached_frames else None, z)
                 for m, c, z in zip(mels, caches, noises, strict=True)]
    assert float((f0 > 80).float().mean()) > 0.75 and float(f0.std()) > 5  # mostly voiced, pitch moving
    assert all(bool(p.detach().abs().min() > 0) for n, p in hift.named_parameters() if n.endswith("bias"))
    for row, (n, want) in enumerate(zip(lengths, alone, strict=True)):
        torch.testing.assert_close(out.speech[row, : n * hop], want.speech[0], atol=FLOAT64_ATOL, rtol=0)
        torch.testing.assert_close(out.source[row, :, : n * hop], want.source[0], atol=FLOAT64_ATOL, rtol=0)
        assert not bool(out.speech[row, n * hop:].any()) and not bool(out.source[row, :, n * hop:].any())


class PaddingVocoder:
    """The bucket rule of vocoder_graphs.GraphedVocoder for final chunks, run eagerly (CUDA graphs need a GPU;
    they are checked against eager there): the stream batching of padded rows on the CPU."""

    def __init__(self, hift: HiFTGenerator, buckets: tuple[int, ...]) -> None:
        self.hift = hift
        self.buckets = buckets
        self.padded_calls = 0

    def final_bucket(self, frames: int, cached: int) -> int | None:
        return next((b for b in self.buckets if b >= frames), None)

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor | None, noise: torch.Tensor,
               frames: torch.Tensor | None = None):
        self.padded_calls += frames is not None
        return self.hift.vocode_with_noise(mel, cache_source, noise, frames)


def test_final_chunks_padded_to_buckets_give_each_stream_its_own_audio() -> None:
    """Streams whose final chunks differ in length (one a whole utterance, one flushing an empty chunk)
    vocoded together with final chunks padded to buckets: every stream's audio equals what unpadded
    calls give it."""
    hift = randomized_voiced_hift(seed=6)
    plans = [[30, 13], [30, 21], [30, 50, 3], [17], [30, 0], [9], [30, 24]]  # the last fills its bucket
    generator = torch.Generator().manual_seed(7)
    mels = [[torch.randn(1, 80, n, generator=generator, dtype=torch.float64) for n in plan] for plan in plans]

    def run(graphs: PaddingVocoder | None) -> list[torch.Tensor]:
        streams = [HiFTStream(hift, seed=10 + i) for i in range(len(plans))]
        pieces: list[list[torch.Tensor]] = [[] for _ in plans]
        for step in range(max(len(plan) for plan in plans)):
            active = [i for i, plan in enumerate(plans) if step < len(plan)]
            audio = vocode_streams([streams[i] for i in active], [mels[i][step] for i in active],
                                   [step == len(plans[i]) - 1 for i in active], graphs)
            for i, piece in zip(active, audio, strict=True):
                pieces[i].append(piece)
        return [torch.cat(p) for p in pieces]

    padding = PaddingVocoder(hift, buckets=(16, 32, 48, 64))
    with torch.no_grad():
        want, got = run(None), run(padding)
    assert padding.padded_calls >= 2
    for plan, w, g in zip(plans, want, got, strict=True):
        assert g.numel() == sum(plan) * SAMPLES_PER_MEL_FRAME
        torch.testing.assert_close(g, w, atol=FLOAT32_ULP, rtol=0)  # the streams' audio is float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_padded_final_chunk_graphs_give_each_row_its_own_audio() -> None:
    """On CUDA: final chunks padded to a length bucket, run from the masked graphs in parts (more rows ×
    frames than one graph may hold), give each row what an eager call at its own length gives it."""
    torch.manual_seed(3)
    hift = HiFTGenerator(TINY).eval().cuda()
    cached = TINY.source_cache_samples
    graphs = GraphedVocoder(hift, [(20, 0)], batches=(1, 2, 4), final_frames=(16, 32, 48), max_row_frames=64)
    lengths = [9, 14, 30, 12, 16]
    bucket = graphs.final_bucket(max(lengths), cached)
    assert bucket == 32
    hop = SAMPLES_PER_MEL_FRAME
    generator = torch.Generator("cuda").manual_seed(4)
    mels = [torch.randn(1, 80, n, device="cuda", generator=generator) for n in lengths]
    sources = [torch.randn(1, 1, cached, device="cuda", generator=generator).tanh() for _ in lengths]
    noises = [torch.randn(1, n * hop - cached, hift.num_harmonics, device="cuda", generator=generator)
              for n in lengths]
    mel = torch.cat([F.pad(m, (0, bucket - n)) for m, n in zip(mels, lengths, strict=True)])
    noise = torch.cat([F.pad(z, (0, 0, 0, (bucket - n) * hop)) for z, n in zip(noises, lengths, strict=True)])
    with torch.inference_mode():
        out = graphs.vocode(mel, torch.cat(sources), noise, torch.tensor(lengths, device="cuda"))
        alone = [hift.vocode_with_noise(m, s, z) for m, s, z in zip(mels, sources, noises, strict=True)]
    assert {shape.batch for shape in graphs.shapes} == {2, 1}  # parts of two rows, then one
    for row, (n, want) in enumerate(zip(lengths, alone, strict=True)):
        # cuDNN picks its kernels (TF32 by default) by shape: ~1e-4 apart on samples ~0.05.
        torch.testing.assert_close(out.speech[row, : n * hop], want.speech[0], atol=5e-4, rtol=1e-3)
        assert not bool(out.speech[row, n * hop:].any())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_chunk_without_its_graph_runs_in_a_graph_of_more_rows() -> None:
    """Paused (a staged warm-up), chunks of 1 and 3 rows whose graphs are not captured yet run in the
    captured 4-row graph of their length and cache (its other rows hold an earlier call's values) and give
    what an eager call gives each row."""
    torch.manual_seed(3)
    hift = HiFTGenerator(TINY).eval().cuda()
    graphs = GraphedVocoder(hift, [(20, 0)], batches=(1, 2, 4))
    hop, generator = SAMPLES_PER_MEL_FRAME, torch.Generator("cuda").manual_seed(5)

    def chunk(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(rows, 80, 20, device="cuda", generator=generator),
                torch.randn(rows, 20 * hop, hift.num_harmonics, device="cuda", generator=generator))

    with torch.inference_mode():
        mel, noise = chunk(4)
        graphs.vocode(mel, None, noise)  # captures the 4-row graph
        graphs.pause()
        for rows in (1, 3):
            mel, noise = chunk(rows)
            out = graphs.vocode(mel, None, noise)
            for row in range(rows):
                want = hift.vocode_with_noise(mel[row : row + 1], None, noise[row : row + 1])
                # cuDNN picks its kernels (TF32 by default) by shape.
                torch.testing.assert_close(out.speech[row], want.speech[0], atol=5e-4, rtol=1e-3)
    assert graphs.shapes == [VocodeShape(4, 20, 0)]


def test_final_chunk_graphs_stop_at_their_row_cap() -> None:
    """Final-chunk graphs exist only up to `max_rows` rows (and `max_row_frames` rows × frames): what the
    warm-up captures; more final chunks in one call run as parts of those buckets, largest first."""
    finals = FinalChunkBuckets(frames=(16, 32), batches=(1, 2, 4, 8, 16), max_row_frames=16 * 16, max_rows=4)
    assert finals.batches_for(16) == finals.batches_for(32) == [1, 2, 4]
    assert finals.parts(11, 32) == [4, 4, 2, 1]
    assert finals.parts(4, 16) == [4]
    assert finals.bucket(17) == 32 and finals.bucket(33) is None
    tight = FinalChunkBuckets(frames=(16, 32, 48), batches=(1, 2, 4), max_row_frames=64)
    assert tight.batches_for(32) == [1, 2]  # rows × frames caps below the row cap
    assert tight.parts(5, 32) == [2, 2, 1]
    assert tight.parts(1, 80) is None  # no graph that long: eager
    service = FinalChunkBuckets(frames=(16,), batches=(1, 2, 4, 8, 16, 32, 64), max_row_frames=10**6)
    assert service.batches_for(16) == [1, 2, 4, 8]  # the service's cap
