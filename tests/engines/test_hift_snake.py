"""HiFT's Snake as one Triton kernel (CUDA) equals the PyTorch definition, alone and inside the vocoder."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from weights import randomize

from engines.config import ModelConfigs
from engines.token2wav.hift import HiFTGenerator, ResBlock, Snake, TimeMajorConv1d

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def snake_definition(x: torch.Tensor, alpha: torch.Tensor, ends: torch.Tensor | None = None) -> torch.Tensor:
    a = alpha[None, :, None]
    y = x + torch.sin(a * x) ** 2 / (a + 1e-9)
    if ends is None:
        return y
    return y * (torch.arange(x.shape[2], device=x.device)[None, None, :] < ends[:, None, None])


@pytest.mark.parametrize("shape", [(1, 64, 30), (3, 128, 1025), (64, 8, 2049)])
def test_the_kernel_equals_the_definition(shape: tuple[int, int, int]) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=generator)).to(CUDA)
    # Trained α: positive, some small, one channel negative; none zero.
    alpha = (torch.rand(shape[1], generator=generator) * 2 + 0.05).to(CUDA)
    alpha[0] = -0.7
    snake = Snake(shape[1]).to(CUDA)
    with torch.no_grad():
        snake.alpha.copy_(alpha)
        got = snake(x)
    torch.testing.assert_close(got, snake_definition(x, alpha), rtol=1e-5, atol=1e-5)


def test_the_kernel_zeroes_each_row_past_its_end() -> None:
    """With per-row ends (a right-padded batch): the definition before each row's end, zero from it on."""
    generator = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(4, 16, 2500, generator=generator)).to(CUDA)
    alpha = (torch.rand(16, generator=generator) * 2 + 0.05).to(CUDA)
    ends = torch.tensor([2500, 1, 1024, 1700], device=CUDA)
    snake = Snake(16).to(CUDA)
    with torch.no_grad():
        snake.alpha.copy_(alpha)
        got = snake(x, ends)
    inside = torch.arange(2500, device=CUDA)[None, None, :] < ends[:, None, None]
    torch.testing.assert_close(got, snake_definition(x, alpha) * inside, rtol=1e-5, atol=1e-5)
    assert not bool(got[~inside.expand_as(got)].any())


def test_the_vocoder_with_the_kernel_equals_it_without(monkeypatch: pytest.MonkeyPatch) -> None:
    # IEEE float32 convolutions and matmuls: in TF32 the kernel's last-bit differences from the definition
    # grew past the tolerance through the decoder (1.5e-5 at 3 of 38400 samples, on an H100).
    monkeypatch.setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee")
    monkeypatch.setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")
    torch.manual_seed(0)
    hift = HiFTGenerator(ModelConfigs.tiny().hift).eval().to(CUDA)
    with torch.no_grad():
        for module in hift.modules():
            if isinstance(module, Snake):
                module.alpha.uniform_(0.2, 1.5)
    mel = torch.randn(2, 80, 40, generator=torch.Generator().manual_seed(1)).to(CUDA)
    noise = hift.draw_noise(torch.Generator().manual_seed(2), 2, 40 * hift.hop_samples, CUDA)
    frames = torch.tensor([40, 23], device=CUDA)  # and a right-padded row: the kernel's masks
    with torch.inference_mode():
        fused = [hift.vocode_with_noise(mel, None, noise), hift.vocode_with_noise(mel, None, noise, frames)]
        monkeypatch.setattr("engines.token2wav.snake.snake", snake_definition)
        monkeypatch.setattr(ResBlock, "fused", ResBlock.unfused)  # its kernels add biases and residuals
        plain = [hift.vocode_with_noise(mel, None, noise), hift.vocode_with_noise(mel, None, noise, frames)]
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got.speech, want.speech, rtol=1e-4, atol=1e-5)


def time_major(x: torch.Tensor) -> torch.Tensor:
    """(B, C, T) laid out as (B, T, C), as HiFT's decoder keeps its activations on CUDA."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def test_snake_of_a_biased_output_and_the_residual_step_equal_their_definitions() -> None:
    """`snake(..., bias=)` is Snake of x + bias; `residual_snake` is v = x + bias + residual and Snake of v
    (or v alone without α): time-major, with row ends, every value non-zero."""
    from engines.token2wav.snake import residual_snake, snake  # Triton: on CUDA machines only

    generator = torch.Generator().manual_seed(11)
    rows, channels, length = 3, 24, 700
    x, residual = (time_major((2 * torch.randn(rows, channels, length, generator=generator)).to(CUDA))
                   for _ in range(2))
    bias = torch.randn(channels, generator=generator).to(CUDA)
    alpha = (torch.rand(channels, generator=generator) * 2 + 0.05).to(CUDA)
    ends = torch.tensor([700, 1, 333], device=CUDA)
    biased = x + bias[None, :, None]
    torch.testing.assert_close(snake(x, alpha, ends, bias=bias), snake_definition(biased, alpha, ends),
                               rtol=1e-5, atol=1e-5)
    total, activated = residual_snake(x, bias, residual, alpha, ends)
    torch.testing.assert_close(total, biased + residual, rtol=1e-6, atol=1e-6)
    assert activated is not None
    torch.testing.assert_close(activated, snake_definition(biased + residual, alpha, ends), rtol=1e-5,
                               atol=1e-5)
    alone, nothing = residual_snake(x, bias, residual, None)
    assert nothing is None
    torch.testing.assert_close(alone, total, rtol=0, atol=0)
    for out in (total, activated, alone):
        assert out.stride() == x.stride()  # time-major, as the next convolution reads it


def resblock_definition(block: ResBlock, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """HiFi-GAN's residual block from the definitions: per dilation x += conv2(snake(conv1(snake(x))))."""
    for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, block.activations1, block.activations2,
                                        strict=True):
        assert isinstance(conv1, TimeMajorConv1d) and isinstance(conv2, TimeMajorConv1d)
        hidden = F.conv1d(snake_definition(x, act1.alpha, ends), conv1.weight, conv1.bias,
                          padding=conv1.padding, dilation=conv1.dilation)
        x = x + F.conv1d(snake_definition(hidden, act2.alpha, ends), conv2.weight, conv2.bias,
                         padding=conv2.padding, dilation=conv2.dilation)
    return x


def test_the_fused_residual_block_equals_its_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ResBlock.fused` (biases added by the Snake kernels, the residual add fused with the next Snake),
    which `forward` takes on CUDA's time-major activations, against the block's definition: non-zero
    weights and biases, a right-padded batch."""
    monkeypatch.setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee")  # exact float32 convolutions
    block = ResBlock(32, 7, (1, 3, 5)).eval()
    randomize(block, seed=3)
    with torch.no_grad():
        for act in (*block.activations1, *block.activations2):
            assert isinstance(act, Snake)
            act.alpha.uniform_(0.2, 1.5)
    block.to(CUDA)
    x = torch.randn(2, 32, 450, generator=torch.Generator().manual_seed(4)).to(CUDA)
    ends = torch.tensor([450, 200], device=CUDA)
    with torch.inference_mode():
        want = resblock_definition(block, x, ends)
        got = block.fused(time_major(x), ends)
    assert want.abs().amax() > 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
