"""HiFT vocoder: NSF harmonic source + ISTFTNet decoder (MODEL_FACTS §7), and its streaming state (§5.6).

Mel (B, 80, T) at 50 Hz → 24 kHz speech (B, 480·T). Parameter names follow the released `hift.pt`,
whose weight-normed convolutions are stored as `<conv>.parametrizations.weight.original0/1`.

`vocode_streams` vocodes the chunks of several streams with one generator call per group of equal
shapes (HiFT's convolutions are not causal, so rows are batched only when no padding is needed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from engines.checkpoints import load_checkpoint, load_strict, strip_prefix
from engines.config import HiFTConfig
from engines.transfer import Download

OLD_WEIGHT_NORM_NAMES = {
    ".weight_g": ".parametrizations.weight.original0",
    ".weight_v": ".parametrizations.weight.original1",
}


def _same_padding(kernel_size: int, dilation: int) -> int:
    return (kernel_size - 1) * dilation // 2


class Snake(nn.Module):
    """x + sin²(α·x)/α with a learned α per channel (linear scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda and x.dtype == torch.float32:
            # One kernel instead of four (engines/token2wav/snake.py); Triton comes with CUDA torch.
            from engines.token2wav.snake import snake

            return snake(x, self.alpha)
        alpha = self.alpha[None, :, None]
        # The epsilon keeps a zero α finite, as in the trained model.
        return torch.addcmul(x, torch.sin(alpha * x).square(), (alpha + 1e-9).reciprocal())


class ResBlock(nn.Module):
    """HiFi-GAN v1 residual block with Snake: per dilation d, x += conv₁(snake(conv_d(snake(x))))."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()

        def conv(dilation: int) -> nn.Conv1d:
            return weight_norm(nn.Conv1d(channels, channels, kernel_size, dilation=dilation,
                                         padding=_same_padding(kernel_size, dilation)))

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2,
                                            strict=True):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class F0Predictor(nn.Module):
    """Pitch in Hz per mel frame: 5 × (conv k3 → ELU), then |Linear → 1|. Receptive field ±5 frames."""

    num_convs = 5

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(self.num_convs):
            layers += [weight_norm(nn.Conv1d(in_channels if i == 0 else channels, channels, 3, padding=1)),
                       nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, 1)

    def forward(self, mel: Tensor) -> Tensor:
        """(B, 80, T) → (B, T)."""
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs()


class HarmonicSource(nn.Module):
    """Merges the harmonic sines and noise into the one-channel excitation: tanh(Linear(harmonics → 1))."""

    def __init__(self, num_harmonics: int) -> None:
        super().__init__()
        self.l_linear = nn.Linear(num_harmonics, 1)

    def forward(self, excitation: Tensor) -> Tensor:
        """(B, L, harmonics) → (B, 1, L)."""
        return torch.tanh(self.l_linear(excitation)).transpose(1, 2)


# NSF noise source: one generator, one per batch row, or the device's global RNG (None).
Noise = torch.Generator | Sequence[torch.Generator] | None


class Vocoded(NamedTuple):
    """One vocoder call: speech (B, L) and source (B, 1, L)."""

    speech: Tensor
    source: Tensor


class HiFTGenerator(nn.Module):
    """The HiFT generator: `forward(mel)` is the reference call; `vocode_with_noise` takes its noise given."""

    stft_window: Tensor  # periodic Hann, n_fft samples (buffer)
    stft_basis: Tensor  # windowed real DFT, float64 (n_fft, 2·bins): see `source_spectrum` (buffer)
    istft_basis: Tensor  # its inverse with the synthesis window, float64 (n_fft, 2·bins) (buffer)
    harmonic_numbers: Tensor  # 1 … nb_harmonics + 1 (buffer)
    crossfade: Tensor  # symmetric Hamming, 2·source_cache_samples: fade-in half, then fade-out (buffer)

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_harmonics = cfg.nb_harmonics + 1
        self.spectrum_bins = cfg.istft_n_fft // 2 + 1
        stft_channels = 2 * self.spectrum_bins
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        stage_channels = [cfg.base_channels // 2 ** (i + 1) for i in range(len(cfg.upsample_rates))]

        self.m_source = HarmonicSource(self.num_harmonics)
        self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, cfg.base_channels, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(2 * ch, ch, k, stride=u, padding=(k - u) // 2))
            for ch, u, k in zip(stage_channels, cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True)
        )
        # The source STFT runs at the final rate; stage i sees it downsampled by the product of the
        # upsampling rates still to come (15, 3, 1 for 8·5·3).
        self.source_downs = nn.ModuleList()
        for i, ch in enumerate(stage_channels):
            stride = math.prod(cfg.upsample_rates[i + 1:])
            self.source_downs.append(
                nn.Conv1d(stft_channels, ch, 1) if stride == 1
                else nn.Conv1d(stft_channels, ch, 2 * stride, stride=stride, padding=stride // 2)
            )
        source_kernels = zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilations, strict=True)
        self.source_resblocks = nn.ModuleList(
            ResBlock(ch, k, d) for ch, (k, d) in zip(stage_channels, source_kernels, strict=True)
        )
        self.resblocks = nn.ModuleList(
            ResBlock(ch, k, d)
            for ch in stage_channels
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilations, strict=True)
        )
        self.conv_post = weight_norm(nn.Conv1d(stage_channels[-1], stft_channels, 7, padding=3))
        self.f0_predictor = F0Predictor(cfg.in_channels, cfg.f0_cond_channels)
        self.register_buffer("stft_window", torch.hann_window(cfg.istft_n_fft), persistent=False)
        forward_basis, inverse_basis = _real_dft_bases(self.stft_window)
        self.register_buffer("stft_basis", forward_basis, persistent=False)
        self.register_buffer("istft_basis", inverse_basis, persistent=False)
        self.register_buffer("harmonic_numbers", torch.arange(1, self.num_harmonics + 1, dtype=torch.float32),
                             persistent=False)
        # Shared by every HiFTStream of this vocoder for the joins between its chunks.
        self.register_buffer("crossfade", torch.hamming_window(2 * cfg.source_cache_samples, periodic=False),
                             persistent=False)

    @property
    def hop_samples(self) -> int:
        """Output samples per mel frame (480)."""
        return self.cfg.hop_samples

    def forward(self, mel: Tensor, cache_source: Tensor | None = None, *,
                generator: Noise = None) -> tuple[Tensor, Tensor]:
        """mel (B, 80, T) → speech (B, 480T) in [-0.99, 0.99] and source (B, 1, 480T).

        `cache_source` (B, 1, S) replaces the first S source samples (streaming continuity). The sine
        phases start at zero at frame 0 of every call, as in the reference (its streaming restarts them
        at each chunk's first cached frame). `generator` (any device) draws the NSF noise, or one
        generator per row draws that row's; None uses the global RNG of the mel's device.
        """
        cached = 0 if cache_source is None else cache_source.shape[-1]
        noise = self.draw_noise(generator, mel.shape[0], mel.shape[2] * self.hop_samples - cached, mel.device)
        out = self.vocode_with_noise(mel, cache_source, noise)
        return out.speech, out.source

    def draw_noise(self, generator: Noise, rows: int, samples: int, device: torch.device) -> Tensor:
        """NSF noise (rows, samples, harmonics) on `device`, for the samples after a call's cache.

        Drawn in sample-major order, so consecutive streaming calls with one CPU generator consume the
        same numbers as one offline call; with one generator per row, each row's own.
        """
        if isinstance(generator, Sequence):
            if len(generator) != rows:
                raise ValueError(f"{len(generator)} noise generators for {rows} rows")
            return torch.stack([torch.randn((samples, self.num_harmonics), generator=g, device=g.device)
                                .to(device) for g in generator])
        source_device = device if generator is None else generator.device
        noise = torch.randn((rows, samples, self.num_harmonics), generator=generator, device=source_device)
        return noise.to(device)

    def vocode_with_noise(self, mel: Tensor, cache_source: Tensor | None, noise: Tensor) -> Vocoded:
        """`forward` with its noise given (`draw_noise`: (B, 480·T − cached samples, harmonics)). It draws
        nothing and never waits for the device, so a CUDA graph can capture it."""
        f0 = self.f0_predictor(mel)
        cached = 0 if cache_source is None else cache_source.shape[-1]
        if cached % self.hop_samples or cached > mel.shape[-1] * self.hop_samples:
            raise ValueError(f"cache_source of {cached} samples must cover whole frames of the "
                             f"{mel.shape[-1]}-frame mel")
        if noise.shape[1] != mel.shape[2] * self.hop_samples - cached:
            raise ValueError(f"noise for {noise.shape[1]} samples; the samples after the cache are "
                             f"{mel.shape[2] * self.hop_samples - cached}")
        source = self.m_source(self._excitation(f0, self._frame_phases(f0), noise))
        if cache_source is not None:
            source = torch.cat([cache_source.to(source.dtype), source[:, :, cached:]], dim=2)
        return Vocoded(self.decode(mel, source), source)

    def _frame_phases(self, f0: Tensor) -> Tensor:
        """Cumulative per-sample phase increment (cycles/sample summed over frames from frame 0), (B, T, H).

        The sample-level phase is this times 480, interpolated between frames.
        """
        increments = torch.remainder(f0.unsqueeze(-1) * self.harmonic_numbers / self.cfg.sampling_rate, 1.0)
        return torch.cumsum(increments, dim=1)

    def _excitation(self, f0: Tensor, phase: Tensor, noise: Tensor) -> Tensor:
        """Harmonic sines where voiced plus Gaussian noise, (B, L, H) at the sample rate.

        `noise` covers the samples after the cache only (the cache overwrites the rest). (The reference
        also adds a random initial phase to sample 0, which its frame-level interpolation never reads, so
        it is left out.)
        """
        hop = self.hop_samples
        sample_phase = F.interpolate((phase * hop).transpose(1, 2), scale_factor=hop, mode="linear")
        sines = self.cfg.nsf_alpha * torch.sin(2 * math.pi * sample_phase).transpose(1, 2)
        voiced = (f0 > self.cfg.nsf_voiced_threshold).to(sines.dtype)
        voiced = voiced.repeat_interleave(hop, dim=1).unsqueeze(-1)
        noise_scale = voiced * self.cfg.nsf_sigma + (1 - voiced) * (self.cfg.nsf_alpha / 3)
        noise = F.pad(noise.to(sines.dtype), (0, 0, sines.shape[1] - noise.shape[1], 0))
        return sines * voiced + noise_scale * noise

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """ISTFTNet decoder: mel (B, 80, T) and source (B, 1, 480T) → speech (B, 480T)."""
        cfg = self.cfg
        source_stft = self.source_spectrum(source.squeeze(1))
        x = self.conv_pre(mel)
        last_stage = len(self.ups) - 1
        for i, (up, down, source_block) in enumerate(zip(self.ups, self.source_downs, self.source_resblocks,
                                                         strict=True)):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == last_stage:
                # One extra frame on the left aligns the 120T upsampled frames with the 120T+1 STFT frames.
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + source_block(down(source_stft))
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            x = sum((block(x) for block in blocks), torch.zeros_like(x)) / self.num_kernels
        x = self.conv_post(F.leaky_relu(x))  # default slope 0.01 here, as trained
        magnitude = torch.exp(x[:, :self.spectrum_bins]).clamp(max=1e2)
        phase = torch.sin(x[:, self.spectrum_bins:])
        speech = self.inverse_stft(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return speech.clamp(-cfg.audio_limit, cfg.audio_limit)

    def source_spectrum(self, source: Tensor) -> Tensor:
        """`torch.stft(source, n_fft, hop, window=Hann, center=True)` with real and imaginary parts as
        channels: (B, L) → (B, 2·(n_fft/2 + 1), L // hop + 1).

        A matmul with the windowed DFT basis instead of cuFFT, which builds a plan (~ms, host side) for
        every signal length and batch it meets first, as the final chunks' eager calls do; in float64,
        since the process runs float32 matmuls in TF32.
        """
        n_fft, hop = self.cfg.istft_n_fft, self.cfg.istft_hop
        padded = F.pad(source[:, None], (n_fft // 2, n_fft // 2), mode="reflect")[:, 0]
        frames = padded.unfold(-1, n_fft, hop)  # (B, F, n_fft)
        basis = self.stft_basis
        return torch.matmul(frames.to(basis.dtype), basis).to(source.dtype).transpose(1, 2)

    def inverse_stft(self, real: Tensor, imag: Tensor) -> Tensor:
        """`torch.istft(real + i·imag, n_fft, hop, window=Hann, center=True)`: real, imag (B, n_fft/2 + 1,
        F) → (B, hop·(F − 1)).

        Inverse DFT as a matmul (float64, as `source_spectrum`) and overlap-add, without istft's check
        that the windows overlap enough, which waits for the device on every call (the periodic Hann
        window at a quarter-window hop always passes).
        """
        n_fft, hop = self.cfg.istft_n_fft, self.cfg.istft_hop
        count = real.shape[2]
        length = n_fft + hop * (count - 1)
        basis = self.istft_basis
        frames = torch.matmul(basis, torch.cat([real, imag], dim=1).to(basis.dtype)).to(real.dtype)
        signal = F.fold(frames, (1, length), (1, n_fft), stride=(1, hop))
        weights = self.stft_window.square()[None, :, None].expand(1, n_fft, count)
        envelope = F.fold(weights, (1, length), (1, n_fft), stride=(1, hop))
        trim = slice(n_fft // 2, length - n_fft // 2)
        return signal[:, 0, 0, trim] / envelope[:, 0, 0, trim]


def _real_dft_bases(window: Tensor) -> tuple[Tensor, Tensor]:
    """float64 (n, 2·(n/2 + 1)) matrices of an n-sample `window`: the analysis basis maps a frame to
    [Re X_k | Im X_k] of its windowed DFT X_k = Σ_t w_t x_t e^{−2πikt/n}; the synthesis basis maps those
    back to the windowed inverse of the one-sided spectrum (irfft: bins 1 … n/2 − 1 count twice, the
    imaginary parts of bins 0 and n/2 not at all)."""
    n = window.numel()
    bins = n // 2 + 1
    t = torch.arange(n, dtype=torch.float64)[:, None]
    angle = 2 * math.pi * t * torch.arange(bins, dtype=torch.float64)[None, :] / n
    w = window.to(torch.float64)[:, None]
    analysis = torch.cat([w * torch.cos(angle), -w * torch.sin(angle)], dim=1)
    weight = torch.full((bins,), 2.0, dtype=torch.float64)
    weight[0] = weight[-1] = 1.0  # n even: bin n/2 is the Nyquist bin, once
    synthesis = torch.cat([w * weight * torch.cos(angle), -w * weight * torch.sin(angle)], dim=1) / n
    return analysis, synthesis


def canonical_hift_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Released HiFT names: drops a `generator.` prefix and renames old `weight_g`/`weight_v` keys."""
    renamed = {}
    for name, tensor in strip_prefix(state, "generator.").items():
        for old, new in OLD_WEIGHT_NORM_NAMES.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
        renamed[name] = tensor
    return renamed


def fold_weight_norm(module: nn.Module) -> None:
    """Replace every weight-norm parametrization by its plain weight g·v/‖v‖ (no per-call norm)."""
    for submodule in module.modules():
        if parametrize.is_parametrized(submodule, "weight"):
            parametrize.remove_parametrizations(submodule, "weight", leave_parametrized=True)


def load_hift(path: Path, cfg: HiFTConfig, device: torch.device | str) -> HiFTGenerator:
    """A HiFT generator in eval mode with the weights of `path`, loaded strictly, weight norm folded.

    The folded module's state dict names plain `weight`s; build a fresh `HiFTGenerator` to save one.
    """
    model = HiFTGenerator(cfg)
    load_strict(model, canonical_hift_state(load_checkpoint(path)), str(path))
    fold_weight_norm(model)
    return model.to(device).eval()


class HiFTStream:
    """Per-request vocoder state: chunks of mel in, final audio out (MODEL_FACTS §5.6).

    Each call vocodes [the last 8 mel frames of the previous call, the new frames], restores the
    previous call's last 3840 source samples over the re-synthesised frames, cross-fades the first 3840
    samples with the held-back speech tail under a Hamming window, and holds back the last 3840 samples
    unless `last`. Concatenating the outputs gives the utterance. As in the reference, every call starts
    its sine phases afresh at its first (cached) frame, so on voiced frames the excitation changes
    phase where the restored source ends, and only the first chunk's frames equal offline output.

    The noise comes from the stream's own generator on the vocoder's device, so a stream's audio does
    not depend on which streams share its batch. On the CPU, whose draws concatenate exactly, a seeded
    stream on unvoiced frames reproduces the offline output with the same seed everywhere but near the
    chunk joins (a CUDA generator rounds its offset per call, so there the noise differs from offline's).
    """

    def __init__(self, hift: HiFTGenerator, *, seed: int | None = None) -> None:
        cfg = hift.cfg
        if cfg.source_cache_samples != cfg.mel_cache_frames * hift.hop_samples:
            raise ValueError(f"source_cache_samples {cfg.source_cache_samples} must equal mel_cache_frames "
                             f"{cfg.mel_cache_frames} × {hift.hop_samples}")
        self._hift: HiFTGenerator | None = hift
        device = hift.stft_window.device
        # On the vocoder's device: batches of many streams draw their noise without host work.
        self._noise = torch.Generator(device)
        if seed is None:
            self._noise.seed()
        else:
            self._noise.manual_seed(seed)
        self._mel: Tensor | None = None
        self._source: Tensor | None = None
        self._speech_tail: Tensor | None = None

    @property
    def nbytes(self) -> int:
        cached = (self._mel, self._source, self._speech_tail)
        return sum(t.nbytes for t in cached if t is not None)

    @torch.inference_mode()
    def process(self, mel: Tensor, last: bool) -> Tensor:
        """mel (1, 80, F) → float32 (samples,) on the CPU; 480·F samples in total over the stream."""
        return vocode_streams([self], [mel], [last])[0]

    @property
    def generator(self) -> HiFTGenerator:
        """The vocoder this stream runs on; raises once the stream is closed."""
        if self._hift is None:
            raise RuntimeError("HiFTStream is closed")
        return self._hift

    def _cache(self) -> Tensor | None:
        """The source samples the next call restores, if any."""
        return self._source

    def _next_input(self, mel: Tensor, last: bool) -> Tensor | None:
        """[cached frames, mel] to vocode now, or None (and the stream closed) when there is nothing."""
        hift = self.generator
        cfg = hift.cfg
        mel = mel.to(hift.stft_window.device, torch.float32)
        if self._mel is not None:
            mel = torch.cat([self._mel, mel], dim=2)
        if mel.shape[2] == 0:
            self.close()
            return None
        if not last and mel.shape[2] < cfg.mel_cache_frames:
            raise ValueError(f"a non-final chunk needs at least {cfg.mel_cache_frames} mel frames "
                             f"with the cache, got {mel.shape[2]}")
        return mel

    def _held_tail(self) -> Tensor:
        """The speech samples held back from the previous call (there was one)."""
        if self._speech_tail is None:
            raise RuntimeError("no speech held back: the stream has not vocoded a chunk")
        return self._speech_tail

    def _keep(self, mel: Tensor, source: Tensor, speech_tail: Tensor) -> None:
        """Hold the caches of a call that was not the last (one row each)."""
        self._mel, self._source, self._speech_tail = mel, source, speech_tail

    def close(self) -> None:
        """Drop the caches; later `process` calls raise. Idempotent."""
        self._hift = None
        self._mel = self._source = self._speech_tail = None


def _emit_rows(streams: Sequence[HiFTStream], lasts: Sequence[bool], mel: Tensor, out: Vocoded,
               speech_tails: Tensor | None) -> list[Tensor]:
    """The final audio of each row of one batched call (on the vocoder's device), all rows at once:
    the first `source_cache_samples` cross-faded with the row's held-back tail (`speech_tails`, one row
    each, None for first chunks) under the Hamming window; unless its stream's chunk is `last`, the row
    holds back its last samples and keeps its caches (the last mel frames and source samples)."""
    hift = streams[0].generator
    overlap, frames = hift.cfg.source_cache_samples, hift.cfg.mel_cache_frames
    speech = out.speech
    if speech_tails is not None:
        fade_in, fade_out = hift.crossfade.split(overlap)
        faded = speech[:, :overlap] * fade_in + speech_tails * fade_out
        speech = torch.cat([faded, speech[:, overlap:]], dim=1)
    audio: list[Tensor] = []
    if not all(lasts):
        # Copies: the caches outlive this call's batch tensors.
        mel_cache, source_cache = mel[:, :, -frames:].clone(), out.source[:, :, -overlap:].clone()
        tail_cache = speech[:, -overlap:].clone()
    for row, (stream, last) in enumerate(zip(streams, lasts, strict=True)):
        if last:
            stream.close()
            audio.append(speech[row])
            continue
        stream._keep(mel_cache[row : row + 1], source_cache[row : row + 1], tail_cache[row])
        audio.append(speech[row, :-overlap])
    return audio


class VocoderGraphs(Protocol):
    """Runs `HiFTGenerator.vocode_with_noise` from CUDA graphs where it can (graphs.GraphedVocoder)."""

    def vocode(self, mel: Tensor, cache_source: Tensor | None, noise: Tensor) -> Vocoded: ...


class HostAudio:
    """The audio of one `launch_vocode_streams` call on its way to the host (one copy for the batch):
    `wait()` returns float32 (samples,) CPU audio per stream, empty for streams that produced none."""

    def __init__(self, pieces: dict[int, Tensor], streams: int) -> None:
        self._order = sorted(pieces)
        self._sizes = [pieces[i].numel() for i in self._order]
        self._streams = streams
        joined = [pieces[i].float() for i in self._order]
        self._download = Download(torch.cat(joined)) if joined else None

    def wait(self) -> list[Tensor]:
        if self._download is None:
            return [torch.zeros(0) for _ in range(self._streams)]
        audio = dict(zip(self._order, self._download.wait().split(self._sizes), strict=True))
        return [audio.get(i, torch.zeros(0)) for i in range(self._streams)]


def vocode_streams(
    streams: Sequence[HiFTStream], mels: Sequence[Tensor], lasts: Sequence[bool],
    graphs: VocoderGraphs | None = None,
) -> list[Tensor]:
    """`launch_vocode_streams`, waiting for its audio."""
    return launch_vocode_streams(streams, mels, lasts, graphs).wait()


@torch.inference_mode()
def launch_vocode_streams(
    streams: Sequence[HiFTStream], mels: Sequence[Tensor], lasts: Sequence[bool],
    graphs: VocoderGraphs | None = None,
) -> HostAudio:
    """`HiFTStream.process` for distinct streams of one generator, without waiting for the device: the
    streams' caches are updated as the work is queued, and the audio comes from `HostAudio.wait()`.

    Streams whose inputs have equal shapes (chunk length with the cached frames, and whether a source
    cache exists) share one batched generator call, from `graphs` where given; each row draws its noise
    from its own stream's generator, so every stream gets exactly what it would alone.
    """
    if not len(streams) == len(mels) == len(lasts):
        raise ValueError(f"{len(streams)} streams, {len(mels)} mels, {len(lasts)} flags")
    pending: dict[int, Tensor] = {}
    groups: dict[tuple[int, bool], list[int]] = {}
    for index, (stream, mel, last) in enumerate(zip(streams, mels, lasts, strict=True)):
        mel_in = stream._next_input(mel, last)
        if mel_in is not None:
            pending[index] = mel_in
            groups.setdefault((mel_in.shape[2], stream._cache() is not None), []).append(index)
    speech: dict[int, Tensor] = {}
    for indices in groups.values():
        members = [streams[i] for i in indices]
        mel = torch.cat([pending[i] for i in indices])
        caches = [cache for s in members if (cache := s._cache()) is not None]
        source = torch.cat(caches) if caches else None
        hift = members[0].generator
        samples = mel.shape[2] * hift.hop_samples - (0 if source is None else source.shape[2])
        noise = hift.draw_noise([s._noise for s in members], len(members), samples, mel.device)
        if graphs is None:
            out = hift.vocode_with_noise(mel, source, noise)
        else:
            out = graphs.vocode(mel, source, noise)
        tails = None if source is None else torch.stack([s._held_tail() for s in members])
        rows_audio = _emit_rows(members, [lasts[i] for i in indices], mel, out, tails)
        speech.update(zip(indices, rows_audio, strict=True))
    return HostAudio(speech, len(streams))
