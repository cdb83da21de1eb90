"""HiFT's Snake as one Triton kernel (CUDA) equals the PyTorch definition, alone and inside the vocoder."""

from __future__ import annotations

import pytest
import torch

from engines.config import ModelConfigs
from engines.token2wav.hift import HiFTGenerator, Snake

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
        plain = [hift.vocode_with_noise(mel, None, noise), hift.vocode_with_noise(mel, None, noise, frames)]
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got.speech, want.speech, rtol=1e-4, atol=1e-5)
