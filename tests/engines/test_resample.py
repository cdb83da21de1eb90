"""engines/resample.py against torchaudio's published resampling formula, evaluated directly here.

torchaudio.functional.resample: every output sample n (at time n / R_out) is a windowed-sinc sum over
the input samples m (at times m / R_in):

    y[n] = Σ_m x[m] · (c / R_in) · sinc(τ) · w(τ),   τ = c · (m / R_in − n / R_out),   |τ| < L
    c = rolloff · min(R_in, R_out),  w(τ) = cos²(π τ / 2L)  or  I0(β √(1 − (τ/L)²)) / I0(β),

zero outside the signal, ⌈N · R_out / R_in⌉ outputs. The reference below sums that formula in float64
for every output sample, with no polyphase table.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from engines.resample import KAISER_BEST, REFERENCE, SincFilter, SincResampler, polyphase_kernel, resample

# Clip rates the voice path meets (decoded files) → the front end's 16 kHz and 24 kHz.
VOICE_PAIRS = [
    (orig, target)
    for orig in (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000, 96000)
    for target in (16000, 24000)
    if orig != target
]
# The service's 24 kHz output → every rate a client may ask for.
OUTPUT_PAIRS = [(24000, rate) for rate in (8000, 16000, 22050, 44100, 48000)]


def formula_resample(x: np.ndarray, r_in: int, r_out: int, sinc: SincFilter) -> np.ndarray:
    lobes = sinc.lowpass_filter_width
    c = sinc.rolloff * min(r_in, r_out)
    n_out = math.ceil(x.size * r_out / r_in)
    m = np.arange(x.size, dtype=np.float64)
    out = np.empty(n_out)
    for n in range(n_out):
        tau = c * (m / r_in - n / r_out)
        inside = np.abs(tau) < lobes
        t = tau[inside]
        if sinc.window == "hann":
            window = np.cos(math.pi * t / (2 * lobes)) ** 2
        else:
            assert sinc.beta is not None
            window = np.i0(sinc.beta * np.sqrt(1 - (t / lobes) ** 2)) / np.i0(sinc.beta)
        out[n] = np.sum(x[inside].astype(np.float64) * (c / r_in) * np.sinc(t) * window)
    return out


def _noise(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    return (0.5 * np.random.default_rng(seed).standard_normal(int(seconds * rate))).astype(np.float32)


@pytest.mark.parametrize(("orig", "target"), VOICE_PAIRS + OUTPUT_PAIRS)
def test_reference_kernel_matches_the_formula(orig: int, target: int) -> None:
    x = _noise(0.03, orig)
    got = resample(x, orig, target)
    expected = formula_resample(x, orig, target, REFERENCE)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize(("orig", "target"), OUTPUT_PAIRS)
def test_kaiser_best_matches_the_formula(orig: int, target: int) -> None:
    x = _noise(0.03, orig, seed=1)
    got = resample(x, orig, target, KAISER_BEST)
    np.testing.assert_allclose(got, formula_resample(x, orig, target, KAISER_BEST), rtol=0, atol=2e-6)


@pytest.mark.parametrize("sinc", [REFERENCE, KAISER_BEST])
@pytest.mark.parametrize(("orig", "target"), VOICE_PAIRS[:4] + OUTPUT_PAIRS)
def test_streaming_in_pieces_equals_the_whole(orig: int, target: int, sinc: SincFilter) -> None:
    x = _noise(0.5, orig, seed=2)
    whole = resample(x, orig, target, sinc)
    rng = np.random.default_rng(3)
    cuts = np.sort(rng.integers(0, x.size, 40))
    resampler = SincResampler(orig, target, sinc)
    pieces = [resampler.process(piece) for piece in np.split(x, cuts)]  # includes empty and 1-sample pieces
    streamed = np.concatenate([*pieces, resampler.flush()])
    assert streamed.size == whole.size == math.ceil(x.size * target / orig)
    # Both are float32 products whose BLAS kernels depend on how many blocks a call has: on such noise
    # each is within 2e-6 of the float64 formula (the tests above), so within 4e-6 of the other (numpy
    # 2.4.6's OpenBLAS: 1.2e-6 apart on one sample of 1.21).
    np.testing.assert_allclose(streamed, whole, rtol=0, atol=4e-6)


def test_equal_rates_are_the_identity() -> None:
    x = _noise(0.1, 16000)
    np.testing.assert_array_equal(resample(x, 16000, 16000), x)


def test_short_inputs_give_the_reference_length() -> None:
    for size in range(0, 8):
        assert resample(np.ones(size, np.float32), 44100, 16000).size == math.ceil(size * 16000 / 44100)


def test_a_flushed_resampler_refuses_more_input() -> None:
    resampler = SincResampler(24000, 16000)
    resampler.flush()
    with pytest.raises(RuntimeError, match="flushed"):
        resampler.process(np.zeros(10, np.float32))


def test_rates_without_a_usable_common_factor_are_refused() -> None:
    with pytest.raises(ValueError, match="share too small a factor"):
        polyphase_kernel(44099, 16000)


# --- frequency response -------------------------------------------------------------------------------


def _tone_gain_db(
    hz: float, orig: int, target: int, sinc: SincFilter, measure_hz: float | None = None
) -> float:
    """Level (dB re the input amplitude) at `measure_hz` (default `hz`) of a resampled `hz` tone."""
    t = np.arange(orig) / orig
    out = resample(np.sin(2 * np.pi * hz * t).astype(np.float32), orig, target, sinc)
    out = out[target // 10 : -target // 10]  # away from the zero-padded ends
    times = np.arange(out.size) / target
    amplitude = 2 * abs(np.mean(out * np.exp(-2j * np.pi * (measure_hz or hz) * times)))
    return 20 * math.log10(max(amplitude, 1e-12))


def _formula_gain_db(hz: float, orig: int, target: int, sinc: SincFilter) -> float:
    """|H(f)| of the formula's filter, from its impulse response sampled at the input rate."""
    lobes, c = sinc.lowpass_filter_width, sinc.rolloff * min(orig, target)
    m = np.arange(-int(lobes * orig / c) - 1, int(lobes * orig / c) + 2)
    tau = np.clip(c * m / orig, -lobes, lobes)
    h = (c / orig) * np.sinc(tau) * np.cos(math.pi * tau / (2 * lobes)) ** 2
    return 20 * math.log10(abs(np.sum(h * np.exp(-2j * np.pi * hz * m / orig))))


@pytest.mark.parametrize("orig", [24000, 44100, 48000])
def test_reference_rolls_off_above_7_khz_at_16_khz_output(orig: int) -> None:
    # The reference's kernel is flat in the speech band and already ~2.5–4 dB down at 7.2–7.6 kHz,
    # where the Kaiser polyphase filter used before was flat: what the speech tokenizer and CAMPPlus
    # were trained on.
    for hz in (1000.0, 4000.0):
        assert abs(_tone_gain_db(hz, orig, 16000, REFERENCE)) < 0.05
    for hz in (7000.0, 7200.0, 7600.0):
        measured = _tone_gain_db(hz, orig, 16000, REFERENCE)
        assert measured == pytest.approx(_formula_gain_db(hz, orig, 16000, REFERENCE), abs=0.05)
    assert _tone_gain_db(7600.0, orig, 16000, REFERENCE) < -3.5


@pytest.mark.parametrize(("orig", "target"), OUTPUT_PAIRS)
def test_output_filter_is_flat_and_rejects_aliases(orig: int, target: int) -> None:
    nyquist = min(orig, target) / 2
    for fraction in (0.25, 0.5, 0.9):
        assert abs(_tone_gain_db(fraction * nyquist, orig, target, KAISER_BEST)) < 0.05
    if target < orig:  # a tone above the output Nyquist must not fold back into the band
        for fraction in (1.02, 1.2):
            hz = fraction * target / 2
            assert _tone_gain_db(hz, orig, target, KAISER_BEST, measure_hz=target - hz) < -100
    # The reference's kernel (not used for output) folds the same 1.02 × Nyquist tone back audibly.
    if target == 16000:
        assert _tone_gain_db(8160.0, orig, target, REFERENCE, measure_hz=7840.0) > -20
