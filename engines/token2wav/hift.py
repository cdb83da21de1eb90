"""HiFT vocoder: NSF harmonic source + ISTFTNet decoder (MODEL_FACTS §7).

Mel (B, 80, T) at 50 Hz → 24 kHz speech (B, 480·T). Parameter names follow the released `hift.pt`,
whose weight-normed convolutions are stored as `<conv>.parametrizations.weight.original0/1`. A batch
may be right-padded (`RowEnds`): each row then computes what it computes alone. Its streaming state is
in hift_stream.py.

On CUDA the decoder's activations are time-major in memory, (B, T, C) seen as (B, C, T): its float32
convolutions run as cuDNN's channels-last (NHWC) kernels, which are the faster ones on an H100 (up to
twice at the 24 kHz stage, `TimeMajorConv1d`), and which cuDNN otherwise reached by converting every
input to NHWC and every output back (~7 % of a 64-stream call, docs/benchmarks.md).

HiFT runs in float32, as the reference does. `use_decoder_dtype` may put the decoder's convolutions from
the mel through the last residual blocks (nearly all of HiFT's work) in a half precision, the pitch, the
harmonic source, conv_post and the STFTs staying float32: faster (cuDNN's bf16 convolutions take 0.4–0.6
of the TF32 ones' time on an H200, docs/benchmarks.md), a departure from the reference whose cost in
audio is for released weights to show.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from engines.checkpoints import load_checkpoint, load_strict, strip_prefix
from engines.config import HiFTConfig

OLD_WEIGHT_NORM_NAMES = {
    ".weight_g": ".parametrizations.weight.original0",
    ".weight_v": ".parametrizations.weight.original1",
}


def _same_padding(kernel_size: int, dilation: int) -> int:
    return (kernel_size - 1) * dilation // 2


def _keep(x: Tensor, valid: Tensor | None) -> Tensor:
    """x with the positions past each row's end zeroed (`valid` a 0/1 mask), or x itself."""
    return x if valid is None else x * valid


class RowEnds:
    """Where each row of a right-padded batch ends, at every rate inside HiFT.

    HiFT's convolutions see both ways, so a row padded past its end computes what the unpadded row
    computes only if every convolution reads zeros there, as its own zero padding would give it: the
    padded call zeroes each convolution's input past the row's end, inside the Snake activations where
    one comes first (`ends`), by a mask elsewhere (`mask`).
    """

    def __init__(self, frames: Tensor) -> None:
        self.frames = frames  # (B,) int64 mel frames of each row, on the batch's device
        self._masks: dict[tuple[int, int, int, torch.dtype], Tensor] = {}
        self._ends: dict[tuple[int, int], Tensor] = {}

    def ends(self, per_frame: int, extra: int = 0) -> Tensor:
        """(B,) int64: position `per_frame`·frames + `extra` of each row, where it ends at that rate."""
        key = (per_frame, extra)
        if key not in self._ends:
            self._ends[key] = self.frames * per_frame + extra
        return self._ends[key]

    def mask(self, length: int, per_frame: int, extra: int = 0, dtype: torch.dtype = torch.float32) -> Tensor:
        """(B, 1, length) 1 before position `per_frame`·frames + `extra` of each row, 0 from there."""
        key = (length, per_frame, extra, dtype)
        if key not in self._masks:
            positions = torch.arange(length, device=self.frames.device)[None, None, :]
            self._masks[key] = (positions < self.ends(per_frame, extra)[:, None, None]).to(dtype)
        return self._masks[key]

    def reflect_index(self, length: int, per_frame: int, pad: int) -> Tensor:
        """(B, length + 2·pad) int64: the positions of a signal of `length` that reflect padding by `pad`
        on both sides reads, each row reflected at its own end (`per_frame`·frames)."""
        ends = self.frames[:, None] * per_frame
        positions = (torch.arange(length + 2 * pad, device=self.frames.device) - pad).abs()[None, :]
        return torch.where(positions < ends, positions, 2 * (ends - 1) - positions).clamp(0, length - 1)

    def last_frame_index(self, length: int) -> Tensor:
        """(B, length) int64: each position, or the row's last frame for positions past it."""
        positions = torch.arange(length, device=self.frames.device)
        # Never below 0: an index out of range would fault the device, not raise.
        return torch.minimum(positions[None, :], (self.frames[:, None] - 1).clamp_min(0))


def _channels_last_2d(x: Tensor) -> Tensor:
    """(B, C, T) as the (B, C, 1, T) channels-last image cuDNN's NHWC kernels read (a view when x is
    time-major; one copy otherwise, as where the mel enters)."""
    return x.unsqueeze(2).contiguous(memory_format=torch.channels_last)


class TimeMajorConv1d(nn.Conv1d):
    """nn.Conv1d (same parameters and state dict) that on CUDA convolves time-major: input and output
    (B, C, T) laid out as (B, T, C). PyTorch's conv1d makes every 3-D input contiguous (B, C, T) first,
    so this calls the 2-D convolution on a channels-last (B, C, 1, T) view (`time_major`). A CPU runs
    nn.Conv1d."""

    def forward(self, x: Tensor) -> Tensor:
        if not x.is_cuda or isinstance(self.padding, str):  # ("same": HiFT's convs give numbers)
            return super().forward(x)
        return self.time_major(x)

    def time_major(self, x: Tensor, with_bias: bool = True) -> Tensor:
        """The convolution of x through the channels-last 2-D path, on any device; without its bias when
        `with_bias` is False (for a kernel that adds it while reading the output: `ResBlock`)."""
        padding = self.padding
        if isinstance(padding, str):
            raise ValueError(f"the time-major path needs numeric padding, not {padding!r}")
        return F.conv2d(_channels_last_2d(x), self.weight.unsqueeze(2), self.bias if with_bias else None,
                        (1, self.stride[0]), (0, padding[0]), (1, self.dilation[0]), self.groups).squeeze(2)


class TimeMajorConvTranspose1d(nn.ConvTranspose1d):
    """nn.ConvTranspose1d, time-major on CUDA as `TimeMajorConv1d`."""

    def forward(self, x: Tensor, output_size: list[int] | None = None) -> Tensor:
        if not x.is_cuda or output_size is not None or isinstance(self.padding, str):
            return super().forward(x, output_size)
        return self.time_major(x)

    def time_major(self, x: Tensor) -> Tensor:
        """The transposed convolution of x through the channels-last 2-D path, on any device."""
        padding = self.padding
        if isinstance(padding, str):
            raise ValueError(f"the time-major path needs numeric padding, not {padding!r}")
        return F.conv_transpose2d(_channels_last_2d(x), self.weight.unsqueeze(2), self.bias,
                                  (1, self.stride[0]), (0, padding[0]), (0, self.output_padding[0]),
                                  self.groups, (1, self.dilation[0])).squeeze(2)


# Activation dtypes the Snake kernels take (they compute in float32 and store in the activation's dtype).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_time_major(x: Tensor) -> bool:
    """Whether (B, C, T) `x` lies in memory as a dense (B, T, C) (what `TimeMajorConv1d` returns)."""
    rows, channels, length = x.shape
    return channels > 1 and x.stride(1) == 1 and x.stride(2) == channels and x.stride(0) == channels * length


def _reflect_first_frame(x: Tensor) -> Tensor:
    """`F.pad(x, (1, 0), mode="reflect")` of (B, C, T), keeping a time-major x time-major (reflect
    padding writes (B, C, T) memory)."""
    if not is_time_major(x):
        return F.pad(x, (1, 0), mode="reflect")
    rows, channels, length = x.shape
    out = x.new_empty(rows, length + 1, channels).transpose(1, 2)
    out[:, :, 1:] = x
    out[:, :, :1] = x[:, :, 1:2]
    return out


class Snake(nn.Module):
    """x + sin²(α·x)/α with a learned α per channel (linear scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor, ends: Tensor | None = None) -> Tensor:
        """`ends` (B,) int64: each row's output is zero from that position on (RowEnds.ends)."""
        if x.is_cuda and x.dtype in KERNEL_DTYPES:
            # One kernel instead of four (engines/token2wav/snake.py); Triton comes with CUDA torch.
            from engines.token2wav.snake import snake

            return snake(x, self.alpha, ends)
        alpha = self.alpha[None, :, None]
        # The epsilon keeps a zero α finite, as in the trained model.
        y = torch.addcmul(x, torch.sin(alpha * x).square(), (alpha + 1e-9).reciprocal())
        if ends is None:
            return y
        return y * (torch.arange(x.shape[2], device=x.device) < ends[:, None, None]).to(y.dtype)


class ResBlock(nn.Module):
    """HiFi-GAN v1 residual block with Snake: per dilation d, x += conv₁(snake(conv_d(snake(x))))."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()

        def conv(dilation: int) -> nn.Conv1d:
            return weight_norm(TimeMajorConv1d(channels, channels, kernel_size, dilation=dilation,
                                               padding=_same_padding(kernel_size, dilation)))

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor, ends: Tensor | None = None) -> Tensor:
        """With `ends` (B,) (a right-padded batch, `RowEnds.ends`), each activation is zeroed from the
        row's end on, so every convolution reads zeros there; the output past the end is not zero."""
        if x.is_cuda and x.dtype in KERNEL_DTYPES and is_time_major(x):
            return self.fused(x, ends)
        return self.unfused(x, ends)

    def unfused(self, x: Tensor, ends: Tensor | None = None) -> Tensor:
        """`forward` one module at a time, as defined."""
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2,
                                            strict=True):
            x = x + conv2(act2(conv1(act1(x, ends)), ends))
        return x

    def fused(self, x: Tensor, ends: Tensor | None = None) -> Tensor:
        """`forward` of a time-major x (CUDA's layout; any device with Triton's interpreter): each
        convolution runs without its bias, which the Snake kernel reading its output adds, and the
        residual add and the next dilation's first Snake are one kernel (engines/token2wav/snake.py). Per
        dilation two elementwise passes instead of five (two Snakes, two bias adds, the residual add),
        and four launches instead of seven."""
        from engines.token2wav.snake import residual_snake, snake

        first_alphas = [cast(Snake, act).alpha for act in self.activations1]
        second_alphas = [cast(Snake, act).alpha for act in self.activations2]
        activated = snake(x, first_alphas[0], ends)
        for index, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2, strict=True)):
            conv1, conv2 = cast(TimeMajorConv1d, conv1), cast(TimeMajorConv1d, conv2)
            hidden = snake(conv1.time_major(activated, with_bias=False), second_alphas[index], ends,
                           bias=conv1.bias)
            following = first_alphas[index + 1] if index + 1 < len(first_alphas) else None
            output = conv2.time_major(hidden, with_bias=False)
            x, after = residual_snake(output, conv2.bias, x, following, ends)
            if after is not None:
                activated = after
        return x


class F0Predictor(nn.Module):
    """Pitch in Hz per mel frame: 5 × (conv k3 → ELU), then |Linear → 1|. Receptive field ±5 frames."""

    num_convs = 5

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(self.num_convs):
            layers += [weight_norm(TimeMajorConv1d(in_channels if i == 0 else channels, channels, 3,
                                                   padding=1)),
                       nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, 1)

    def forward(self, mel: Tensor, valid: Tensor | None = None) -> Tensor:
        """(B, 80, T) → (B, T); `valid` (B, 1, T) zeroes each conv's output past each row's end
        (`RowEnds.mask`)."""
        x = mel
        for layer in self.condnet:
            x = layer(x)
            if isinstance(layer, nn.Conv1d):
                x = _keep(x, valid)
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs()


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
        self.conv_pre = weight_norm(TimeMajorConv1d(cfg.in_channels, cfg.base_channels, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(TimeMajorConvTranspose1d(2 * ch, ch, k, stride=u, padding=(k - u) // 2))
            for ch, u, k in zip(stage_channels, cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True)
        )
        # The source STFT runs at the final rate; stage i sees it downsampled by the product of the
        # upsampling rates still to come (15, 3, 1 for 8·5·3).
        self.source_downs = nn.ModuleList()
        for i, ch in enumerate(stage_channels):
            stride = math.prod(cfg.upsample_rates[i + 1:])
            self.source_downs.append(
                TimeMajorConv1d(stft_channels, ch, 1) if stride == 1
                else TimeMajorConv1d(stft_channels, ch, 2 * stride, stride=stride, padding=stride // 2)
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
        self.conv_post = weight_norm(TimeMajorConv1d(stage_channels[-1], stft_channels, 7, padding=3))
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

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype of the mel, noise and cached source HiFT takes (its pitch predictor's)."""
        return self.f0_predictor.classifier.weight.dtype

    @property
    def decoder_dtype(self) -> torch.dtype:
        """The decoder's dtype: the input dtype unless `use_decoder_dtype` changed it."""
        return self.conv_pre.weight.dtype

    def use_decoder_dtype(self, dtype: torch.dtype) -> None:
        """Run the decoder's convolutions from conv_pre to the last residual blocks (the upsampling, the
        source's downsampling, every residual block) in `dtype`; the pitch predictor, the harmonic source,
        conv_post, both STFTs and the output keep the input dtype. Not the reference's numerics (see the
        module docstring)."""
        if dtype not in KERNEL_DTYPES:
            raise ValueError(f"HiFT's decoder runs in one of {KERNEL_DTYPES}, not {dtype}")
        for module in (self.conv_pre, self.ups, self.source_downs, self.source_resblocks, self.resblocks):
            module.to(dtype)

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

    def vocode_with_noise(self, mel: Tensor, cache_source: Tensor | None, noise: Tensor,
                          frames: Tensor | None = None) -> Vocoded:
        """`forward` with its noise given (`draw_noise`: (B, 480·T − cached samples, harmonics)). It draws
        nothing and never waits for the device, so a CUDA graph can capture it.

        frames: (B,) int64 on the mel's device, each row's real mel frames when the batch is right-padded
        to T (whatever the padding holds): each row's speech and source then equal the unpadded row's up
        to its 480·frames samples, and are zero after them. Its noise is read up to there only.
        """
        cached = 0 if cache_source is None else cache_source.shape[-1]
        if cached % self.hop_samples or cached > mel.shape[-1] * self.hop_samples:
            raise ValueError(f"cache_source of {cached} samples must cover whole frames of the "
                             f"{mel.shape[-1]}-frame mel")
        if noise.shape[1] != mel.shape[2] * self.hop_samples - cached:
            raise ValueError(f"noise for {noise.shape[1]} samples; the samples after the cache are "
                             f"{mel.shape[2] * self.hop_samples - cached}")
        ends = None if frames is None else RowEnds(frames)
        if ends is not None:
            mel = mel * ends.mask(mel.shape[2], 1)
        f0 = self.f0_predictor(mel, None if ends is None else ends.mask(mel.shape[2], 1))
        phases = self._frame_phases(f0)
        if ends is not None:
            # The sample-rate interpolation holds a row's last frame past it, as at the end of a batch.
            phases = phases.gather(1, ends.last_frame_index(phases.shape[1])[:, :, None].expand_as(phases))
        source = self.m_source(self._excitation(f0, phases, noise))
        if cache_source is not None:
            source = torch.cat([cache_source.to(source.dtype), source[:, :, cached:]], dim=2)
        if ends is not None:
            source = source * ends.mask(source.shape[2], self.hop_samples)
        return Vocoded(self.decode(mel, source, ends), source)

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

    def decode(self, mel: Tensor, source: Tensor, ends: RowEnds | None = None) -> Tensor:
        """ISTFTNet decoder: mel (B, 80, T) and source (B, 1, 480T) → speech (B, 480T); with `ends`,
        rows right-padded as in `vocode_with_noise` (every convolution reads zeros past a row's end:
        the residual blocks zero their Snake outputs, and `x` is masked before the other convolutions)."""
        cfg, dtype = self.cfg, self.decoder_dtype

        def keep(x: Tensor, per_frame: int, extra: int = 0) -> Tensor:
            return x if ends is None else x * ends.mask(x.shape[2], per_frame, extra, x.dtype)

        def row_ends(per_frame: int, extra: int = 0) -> Tensor | None:
            return None if ends is None else ends.ends(per_frame, extra)

        source_stft = self.source_spectrum(source.squeeze(1), ends).to(dtype)
        x = self.conv_pre(mel.to(dtype))
        last_stage = len(self.ups) - 1
        per_frame, extra = 1, 0
        for i, (up, down, source_block) in enumerate(zip(self.ups, self.source_downs, self.source_resblocks,
                                                         strict=True)):
            x = up(F.leaky_relu(keep(x, per_frame, extra), cfg.lrelu_slope))
            per_frame *= cfg.upsample_rates[i]
            if i == last_stage:
                # One extra frame on the left aligns the 120T upsampled frames with the 120T+1 STFT frames.
                x = _reflect_first_frame(x)
                extra = 1
            stage_ends = row_ends(per_frame, extra)
            x = x + source_block(down(source_stft), stage_ends)
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            outputs = [block(x, stage_ends) for block in blocks]
            x = outputs[0]
            for output in outputs[1:]:  # from the first output, not from zeros: one pass less, same sums
                x = x + output
            x = x / self.num_kernels
        # Default slope 0.01 here, as trained. conv_post in the mel's precision: its output becomes
        # exp(magnitude) and sin(phase), where a half's rounding would be amplified.
        x = self.conv_post(F.leaky_relu(keep(x, per_frame, extra)).to(mel.dtype))
        magnitude = torch.exp(x[:, :self.spectrum_bins]).clamp(max=1e2)
        phase = torch.sin(x[:, self.spectrum_bins:])
        if ends is None:
            speech = self.inverse_stft(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        else:
            frames_valid = ends.mask(x.shape[2], per_frame, extra)
            speech = self.inverse_stft(magnitude * torch.cos(phase) * frames_valid,
                                       magnitude * torch.sin(phase) * frames_valid, frames_valid)
        speech = speech.clamp(-cfg.audio_limit, cfg.audio_limit)
        return speech if ends is None else speech * ends.mask(speech.shape[1], self.hop_samples)[:, 0]

    def source_spectrum(self, source: Tensor, ends: RowEnds | None = None) -> Tensor:
        """`torch.stft(source, n_fft, hop, window=Hann, center=True)` with real and imaginary parts as
        channels: (B, L) → (B, 2·(n_fft/2 + 1), L // hop + 1); with `ends`, each row's own (its reflect
        padding taken at its end, its frames past that zero).

        A matmul with the windowed DFT basis instead of cuFFT, which builds a plan (~ms, host side) for
        every signal length and batch it meets first, as the final chunks' eager calls do; in float64,
        since the process runs float32 matmuls in TF32.
        """
        n_fft, hop = self.cfg.istft_n_fft, self.cfg.istft_hop
        if ends is None:
            padded = F.pad(source[:, None], (n_fft // 2, n_fft // 2), mode="reflect")[:, 0]
        else:
            padded = source.gather(1, ends.reflect_index(source.shape[1], self.hop_samples, n_fft // 2))
        frames = padded.unfold(-1, n_fft, hop)  # (B, F, n_fft)
        basis = self.stft_basis
        spectrum = torch.matmul(frames.to(basis.dtype), basis).to(source.dtype).transpose(1, 2)
        if ends is None:
            return spectrum
        return spectrum * ends.mask(spectrum.shape[2], self.hop_samples // hop, 1)

    def inverse_stft(self, real: Tensor, imag: Tensor, frames_valid: Tensor | None = None) -> Tensor:
        """`torch.istft(real + i·imag, n_fft, hop, window=Hann, center=True)`: real, imag (B, n_fft/2 + 1,
        F) → (B, hop·(F − 1)). `frames_valid` (B, 1, F): each row's own, of its valid frames (zero
        after them, in `real` and `imag` too); its window envelope counts those frames alone.

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
        if frames_valid is not None:
            weights = weights * frames_valid
        envelope = F.fold(weights, (1, length), (1, n_fft), stride=(1, hop))
        trim = slice(n_fft // 2, length - n_fft // 2)
        if frames_valid is None:
            return signal[:, 0, 0, trim] / envelope[:, 0, 0, trim]
        # Past a row's frames both are zero: 0 there, not 0/0.
        return signal[:, 0, 0, trim] / envelope[:, 0, 0, trim].clamp_min(1e-11)


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


def load_hift(path: Path, cfg: HiFTConfig, device: torch.device | str,
              decoder_dtype: torch.dtype = torch.float32) -> HiFTGenerator:
    """A HiFT generator in eval mode with the weights of `path`, loaded strictly, weight norm folded, its
    decoder in `decoder_dtype` (`HiFTGenerator.use_decoder_dtype`; float32 as the reference).

    The folded module's state dict names plain `weight`s; build a fresh `HiFTGenerator` to save one.
    """
    model = HiFTGenerator(cfg)
    load_strict(model, canonical_hift_state(load_checkpoint(path)), str(path))
    fold_weight_norm(model)
    model.to(device).eval()
    model.use_decoder_dtype(decoder_dtype)
    return model
