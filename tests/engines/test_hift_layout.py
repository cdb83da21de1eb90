"""HiFT's time-major decoder on CUDA (hift.TimeMajorConv1d and friends) computes what the (B, C, T) one
does: each convolution against PyTorch's own, the Snake kernel on time-major activations against its
definition, and the whole vocoder on the GPU against the same weights on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_hift_snake import snake_definition
from weights import randomize

from engines.config import ModelConfigs
from engines.token2wav.hift import (
    HiFTGenerator,
    Snake,
    TimeMajorConv1d,
    TimeMajorConvTranspose1d,
    _reflect_first_frame,
)

CUDA = torch.device("cuda")
on_gpu = pytest.mark.gpu
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _time_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _is_time_major(x: torch.Tensor) -> bool:
    return x.stride(1) == 1 and x.stride(2) == x.shape[1]


def test_the_reflected_first_frame_keeps_the_layout_and_the_values() -> None:
    x = torch.randn(3, 5, 7)
    for layout in (x, _time_major(x)):
        padded = _reflect_first_frame(layout)
        torch.testing.assert_close(padded, F.pad(x, (1, 0), mode="reflect"), rtol=0, atol=0)
        assert _is_time_major(padded) == _is_time_major(layout)


def _equal_from_both_layouts(conv: torch.nn.Module, x: torch.Tensor, want: torch.Tensor) -> None:
    """`conv` of x stored (B, C, T) and stored time-major: `want` either way, and a time-major output."""
    for layout in (x, _time_major(x)):
        got = conv(layout)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert _is_time_major(got)


@pytest.mark.parametrize(("kernel", "dilation", "stride"),
                         [(3, 1, 1), (11, 5, 1), (7, 3, 1), (30, 1, 15), (1, 1, 1)])
def test_the_time_major_path_equals_conv1d_on_the_cpu_too(kernel: int, dilation: int, stride: int) -> None:
    """The 2-D channels-last formulation CUDA runs, checked where CI runs (a CPU's kernels)."""
    torch.manual_seed(kernel)
    padding = stride // 2 if stride > 1 else dilation * (kernel - 1) // 2
    conv = TimeMajorConv1d(24, 16, kernel, stride=stride, dilation=dilation, padding=padding)
    x = torch.randn(3, 24, 301)
    want = F.conv1d(x, conv.weight, conv.bias, stride, padding, dilation)
    for layout in (x, _time_major(x)):
        torch.testing.assert_close(conv.time_major(layout), want, rtol=1e-5, atol=1e-5)
    upsample = TimeMajorConvTranspose1d(32, 16, 11, stride=5, padding=3)
    x = torch.randn(2, 32, 57)
    want = F.conv_transpose1d(x, upsample.weight, upsample.bias, 5, 3)
    torch.testing.assert_close(upsample.time_major(_time_major(x)), want, rtol=1e-5, atol=1e-5)


def test_the_whole_time_major_decoder_equals_the_plain_one_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every HiFT conv through the time-major path (as on CUDA), the rest of the decoder then on
    time-major activations (masks, residual sums, the reflect pad, Snake): the same speech, plain batch
    and right-padded, as the CPU's (B, C, T) decoder."""
    hift = HiFTGenerator(ModelConfigs.tiny().hift).eval()
    randomize(hift, seed=7)
    mel = torch.randn(2, 80, 40, generator=torch.Generator().manual_seed(1))
    noise = hift.draw_noise(torch.Generator().manual_seed(2), 2, 40 * hift.hop_samples, torch.device("cpu"))
    frames = torch.tensor([40, 23])
    with torch.inference_mode():
        plain = [hift.vocode_with_noise(mel, None, noise).speech,
                 hift.vocode_with_noise(mel, None, noise, frames).speech]
        monkeypatch.setattr(TimeMajorConv1d, "forward", TimeMajorConv1d.time_major)
        monkeypatch.setattr(TimeMajorConvTranspose1d, "forward", lambda self, x: self.time_major(x))
        time_major = [hift.vocode_with_noise(mel, None, noise).speech,
                      hift.vocode_with_noise(mel, None, noise, frames).speech]
    for got, want in zip(time_major, plain, strict=True):
        assert want.abs().amax() > 0.1
        # Same float32 arithmetic in another summation order, magnified at a few samples by HiFT's exp and
        # sin (5e-4 at most here, ~6e-4 between an H100 and a CPU); a wrong tap or layout is off everywhere.
        error = (got - want).abs()
        assert error.amax() < 2e-3 and error.mean() < 1e-5


@pytest.fixture
def exact_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """IEEE float32 convolutions for this test (the service runs them in TF32): both layouts' kernels
    then agree to float rounding, so a wrong tap, stride or layout would show."""
    monkeypatch.setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee")


@on_gpu
@cuda_only
@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize(("kernel", "dilation", "stride"),
                         [(3, 1, 1), (11, 5, 1), (7, 3, 1), (30, 15, 15), (1, 1, 1)])
def test_a_time_major_convolution_equals_conv1d(kernel: int, dilation: int, stride: int) -> None:
    torch.manual_seed(kernel)
    padding = stride // 2 if stride > 1 else dilation * (kernel - 1) // 2
    dilation = 1 if stride > 1 else dilation
    conv = TimeMajorConv1d(24, 16, kernel, stride=stride, dilation=dilation, padding=padding).to(CUDA)
    x = torch.randn(3, 24, 301, device=CUDA)
    want = F.conv1d(x, conv.weight, conv.bias, stride, padding, dilation)
    _equal_from_both_layouts(conv, x, want)


@on_gpu
@cuda_only
@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize(("kernel", "stride"), [(16, 8), (11, 5), (7, 3)])
def test_a_time_major_transposed_convolution_equals_conv_transpose1d(kernel: int, stride: int) -> None:
    torch.manual_seed(kernel)
    padding = (kernel - stride) // 2
    conv = TimeMajorConvTranspose1d(32, 16, kernel, stride=stride, padding=padding).to(CUDA)
    x = torch.randn(2, 32, 57, device=CUDA)
    want = F.conv_transpose1d(x, conv.weight, conv.bias, stride, padding)
    _equal_from_both_layouts(conv, x, want)


@on_gpu
@cuda_only
@pytest.mark.parametrize("channels", [64, 100, 256])
def test_the_snake_kernel_on_time_major_activations_equals_the_definition(channels: int) -> None:
    generator = torch.Generator().manual_seed(channels)
    x = _time_major((3 * torch.randn(3, channels, 1501, generator=generator)).to(CUDA))
    alpha = (torch.rand(channels, generator=generator) * 2 + 0.05).to(CUDA)
    alpha[0] = -0.7
    ends = torch.tensor([1501, 1, 733], device=CUDA)
    snake = Snake(channels).to(CUDA)
    with torch.no_grad():
        snake.alpha.copy_(alpha)
        plain, masked = snake(x), snake(x, ends)
    torch.testing.assert_close(plain, snake_definition(x, alpha), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked, snake_definition(x, alpha, ends), rtol=1e-5, atol=1e-5)
    assert _is_time_major(plain) and _is_time_major(masked)


@on_gpu
@cuda_only
@pytest.mark.usefixtures("exact_float32")
def test_the_vocoder_on_the_gpu_is_as_close_to_the_cpu_as_pytorchs_own_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same non-zero weights, mel and noise (a plain and a right-padded batch) through the GPU's
    time-major decoder, the GPU's (B, C, T) one (PyTorch's conv1d) and the CPU's, matmuls in IEEE float32
    too. Summation order differs between devices, and HiFT's exp and sin magnify it (measured on an
    H100: up to ~6e-4 of a 0.99 full scale either way); a wrong tap or layout would be off by far more
    than PyTorch's own GPU path is."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")
    hift = HiFTGenerator(ModelConfigs.tiny().hift).eval()
    randomize(hift, seed=7)
    mel = torch.randn(2, 80, 40, generator=torch.Generator().manual_seed(1))
    noise = hift.draw_noise(torch.Generator().manual_seed(2), 2, 40 * hift.hop_samples, torch.device("cpu"))
    frames = torch.tensor([40, 23])

    def both(device: torch.device) -> list[torch.Tensor]:
        hift.to(device)
        args = (mel.to(device), None, noise.to(device))
        return [hift.vocode_with_noise(*args).speech.cpu(),
                hift.vocode_with_noise(*args, frames.to(device)).speech.cpu()]

    with torch.inference_mode():
        cpu, time_major = both(torch.device("cpu")), both(CUDA)
        monkeypatch.setattr(TimeMajorConv1d, "forward", torch.nn.Conv1d.forward)
        monkeypatch.setattr(TimeMajorConvTranspose1d, "forward", torch.nn.ConvTranspose1d.forward)
        plain = both(CUDA)
    for ours, theirs, want in zip(time_major, plain, cpu, strict=True):
        assert want.abs().amax() > 0.1
        ours_error, their_error = (ours - want).abs(), (theirs - want).abs()
        assert ours_error.amax() <= 2 * their_error.amax() + 1e-6
        assert ours_error.mean() <= 2 * their_error.mean() + 1e-7
