"""Band-limited sinc resampling with the kernel of `torchaudio.functional.resample`, offline and streaming.

Both rates are divided by their gcd: `orig` input samples map to `new` output samples. Output sample
`p` of block `j` (time `j + p / new` in units of `orig` input samples) is

    y[j·new + p] = Σ_k x[j·orig + k − width] · h_p(k),   k ∈ [0, 2·width + orig)
    h_p(k) = (f / orig) · sinc(π·τ) · w(τ),   τ = clamp(f · ((k − width) / orig − p / new), ±L)

with f = rolloff · min(orig, new) (the cut-off in cycles per block), L = `lowpass_filter_width`
zero crossings on each side, width = ⌈L · orig / f⌉ and the window w(τ) = cos²(π·τ / 2L) (Hann) or
I0(β·√(1 − (τ/L)²)) / I0(β) (Kaiser). Input outside the signal is zero; the output has ⌈N · new / orig⌉
samples. `torchaudio.functional.resample`'s defaults (Hann, L = 6, rolloff 0.99) are `REFERENCE`, the
resampler of CosyVoice's front end; `KAISER_BEST` is torchaudio's documented high-quality preset.

`SincResampler` keeps the filter history between calls, so an utterance fed in pieces gives exactly the
samples of `resample` on the whole (the last `width + orig` inputs wait for more input or `flush`).
It holds only numpy buffers (no threads, no native handles): dropping it releases everything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Literal

import numpy as np

# Polyphase tables above this many entries (32 MiB of float32) are refused: they come from rates whose
# gcd is tiny (44099 Hz → 16 kHz would need 16000 × 44133 taps), never from the rates audio files use.
MAX_KERNEL_ENTRIES = 1 << 23
# Blocks filtered per matrix product: bounds the copied input windows of a long clip (~10 MiB).
_BLOCKS_PER_PRODUCT = 8192


@dataclass(frozen=True)
class SincFilter:
    """The windowed-sinc low-pass of one resampler (torchaudio's `resampling_method` and its knobs)."""

    window: Literal["hann", "kaiser"] = "hann"
    lowpass_filter_width: int = 6
    rolloff: float = 0.99
    beta: float | None = None  # Kaiser only

    def __post_init__(self) -> None:
        if self.lowpass_filter_width <= 0:
            raise ValueError(f"lowpass_filter_width must be positive, got {self.lowpass_filter_width}")
        if not 0.0 < self.rolloff <= 1.0:
            raise ValueError(f"rolloff must be in (0, 1], got {self.rolloff}")
        if (self.beta is not None) != (self.window == "kaiser"):
            raise ValueError("beta is set for, and only for, the Kaiser window")


REFERENCE = SincFilter()
KAISER_BEST = SincFilter("kaiser", 64, 0.9475937167399596, 14.769656459379492)


@dataclass(frozen=True)
class PolyphaseKernel:
    """`taps` (new, 2·width + orig): row p weights the block's input window for output phase p."""

    orig: int
    new: int
    width: int
    taps: np.ndarray


def reduced_rates(orig_rate: int, target_rate: int) -> tuple[int, int]:
    if orig_rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} → {target_rate}")
    factor = math.gcd(orig_rate, target_rate)
    return orig_rate // factor, target_rate // factor


@cache
def polyphase_kernel(orig_rate: int, target_rate: int, sinc: SincFilter = REFERENCE) -> PolyphaseKernel:
    """The float32 polyphase table of `orig_rate` → `target_rate` (computed in float64, then rounded)."""
    orig, new = reduced_rates(orig_rate, target_rate)
    cutoff = sinc.rolloff * min(orig, new)
    lobes = sinc.lowpass_filter_width
    width = math.ceil(lobes * orig / cutoff)
    if new * (2 * width + orig) > MAX_KERNEL_ENTRIES:
        raise ValueError(
            f"cannot resample {orig_rate} Hz → {target_rate} Hz: the rates share too small a factor "
            f"({orig}:{new} after dividing by their gcd)"
        )
    offsets = np.arange(-width, width + orig, dtype=np.float64) / orig
    phases = np.arange(new, dtype=np.float64)[:, None] / new
    tau = np.clip(cutoff * (offsets[None, :] - phases), -lobes, lobes)
    if sinc.window == "hann":
        window = np.cos(tau * math.pi / (2 * lobes)) ** 2
    else:
        assert sinc.beta is not None
        window = np.i0(sinc.beta * np.sqrt(1.0 - (tau / lobes) ** 2)) / np.i0(sinc.beta)
    taps = (cutoff / orig) * np.sinc(tau) * window
    table = taps.astype(np.float32)
    table.setflags(write=False)  # cached and shared between resamplers
    return PolyphaseKernel(orig, new, width, table)


class SincResampler:
    """Stateful `orig_rate` → `target_rate` resampling of one float32 stream (identity when equal).

    `process` returns the output samples whose filter window is complete; `flush` ends the stream with
    the reference's zero padding and trims the total to ⌈N · new / orig⌉ samples. Not thread-safe:
    one owner per stream.
    """

    def __init__(self, orig_rate: int, target_rate: int, sinc: SincFilter = REFERENCE) -> None:
        self.orig_rate = orig_rate
        self.target_rate = target_rate
        self._kernel = None if orig_rate == target_rate else polyphase_kernel(orig_rate, target_rate, sinc)
        width = 0 if self._kernel is None else self._kernel.width
        self._pending = np.zeros(width, dtype=np.float32)  # inputs not yet behind a finished block
        self._received = 0
        self._emitted = 0
        self._finished = False

    def process(self, samples: np.ndarray) -> np.ndarray:
        if self._finished:
            raise RuntimeError("the resampler was flushed; make a new one for a new stream")
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._kernel is None:
            return samples
        self._received += samples.size
        self._pending = np.concatenate([self._pending, samples])
        return self._run_blocks()

    def flush(self) -> np.ndarray:
        """The samples still inside the filter; the resampler is finished afterwards."""
        if self._finished:
            raise RuntimeError("the resampler was already flushed")
        self._finished = True
        if self._kernel is None:
            return np.zeros(0, dtype=np.float32)
        kernel = self._kernel
        self._pending = np.concatenate([self._pending, np.zeros(kernel.width + kernel.orig, np.float32)])
        tail = self._run_blocks()
        total = -(-self._received * kernel.new // kernel.orig)  # ⌈N · new / orig⌉ in exact integers
        return tail[: max(0, total - self._emitted + tail.size)]

    def _run_blocks(self) -> np.ndarray:
        kernel = self._kernel
        assert kernel is not None
        span = kernel.taps.shape[1]
        blocks = 0 if self._pending.size < span else (self._pending.size - span) // kernel.orig + 1
        if blocks == 0:
            return np.zeros(0, dtype=np.float32)
        windows = np.lib.stride_tricks.sliding_window_view(self._pending, span)[:: kernel.orig][:blocks]
        # A contiguous copy makes the product one BLAS call (several times faster than strided input).
        out = np.concatenate([
            (np.ascontiguousarray(windows[start : start + _BLOCKS_PER_PRODUCT]) @ kernel.taps.T).reshape(-1)
            for start in range(0, blocks, _BLOCKS_PER_PRODUCT)
        ])
        self._pending = self._pending[blocks * kernel.orig :].copy()
        self._emitted += out.size
        return out


def resample(
    samples: np.ndarray, orig_rate: int, target_rate: int, sinc: SincFilter = REFERENCE
) -> np.ndarray:
    """`samples` (1-D float) at `target_rate`: `torchaudio.functional.resample` with `sinc`'s settings."""
    if orig_rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} → {target_rate}")
    resampler = SincResampler(orig_rate, target_rate, sinc)
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"expected mono 1-D samples, got shape {samples.shape}")
    return np.concatenate([resampler.process(samples), resampler.flush()])
