"""HiFT's convolution kernel (engines/token2wav/conv_kernel.py) equals its definition: conv1d with zero
padding, then bias, residual and Snake as `snake.residual_snake` computes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.token2wav.conv_kernel import ConvTiles, conv_time_major, tap_major_weight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def time_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def snake_definition(v: torch.Tensor, alpha: torch.Tensor, ends: torch.Tensor | None) -> torch.Tensor:
    a = alpha[None, :, None]
    y = v + torch.sin(a * v) ** 2 / (a + 1e-9)
    if ends is None:
        return y
    return y * (torch.arange(v.shape[2], device=v.device)[None, None, :] < ends[:, None, None])


@pytest.fixture(autouse=True)
def ieee_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference in IEEE float32; the kernel's TF32 products then differ by TF32's rounding only.
    monkeypatch.setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee")


# (rows, in, out, length, taps, dilation): HiFT's kernel sizes and dilations, its stage widths, lengths
# shorter than a tile, not a multiple of one, and a tap reach longer than the row.
CASES = [(1, 64, 64, 30, 3, 1), (3, 128, 128, 241, 7, 3), (2, 256, 256, 130, 11, 5), (4, 64, 64, 7, 11, 5),
         (2, 64, 128, 300, 7, 5)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tiles", [ConvTiles(), ConvTiles(64, 128, 64, 4, 2)])
def test_the_epilogues_equal_the_definition(case: tuple[int, ...], tiles: ConvTiles) -> None:
    rows, c_in, c_out, length, taps, dilation = case
    if c_out % tiles.outputs:
        pytest.skip("channels not a multiple of the tile")
    generator = torch.Generator().manual_seed(sum(case))
    x = time_major(torch.randn(rows, c_in, length, generator=generator)).to(CUDA)
    weight = (torch.randn(c_out, c_in, taps, generator=generator) / (c_in * taps) ** 0.5).to(CUDA)
    bias = (0.3 * torch.randn(c_out, generator=generator)).to(CUDA)
    residual = time_major(torch.randn(rows, c_out, length, generator=generator)).to(CUDA)
    alpha = (torch.rand(c_out, generator=generator) * 1.5 + 0.05).to(CUDA)
    alpha[0] = -0.6
    ends = torch.randint(1, length + 1, (rows,), generator=generator).to(CUDA)
    padding = dilation * (taps - 1) // 2
    conv = F.conv1d(x.contiguous(), weight, None, padding=padding, dilation=dilation)
    taps_weight = tap_major_weight(weight)
    tolerance = {"rtol": 5e-3, "atol": 5e-3}  # TF32 products: ~7e-4 per output over taps·in terms

    plain, none = conv_time_major(x, taps_weight, None, dilation, padding, tiles=tiles)
    assert none is None and plain is not None and plain.stride(1) == 1
    torch.testing.assert_close(plain, conv, **tolerance)

    # conv_d's step in a residual block: bias, then Snake, only the Snake written.
    none, activated = conv_time_major(x, taps_weight, bias, dilation, padding, alpha=alpha, ends=ends,
                                      write_sum=False, tiles=tiles)
    assert none is None and activated is not None
    expected = snake_definition(conv + bias[None, :, None], alpha, ends)
    torch.testing.assert_close(activated, expected, **tolerance)

    # conv_1's: bias and the block's input added, the sum and the next Snake written.
    total, following = conv_time_major(x, taps_weight, bias, dilation, padding, residual=residual,
                                       alpha=alpha, tiles=tiles)
    expected = conv + bias[None, :, None] + residual
    assert total is not None and following is not None
    torch.testing.assert_close(total, expected, **tolerance)
    torch.testing.assert_close(following, snake_definition(expected, alpha, None), **tolerance)


def test_bad_arguments_are_refused() -> None:
    x = time_major(torch.randn(1, 64, 20)).to(CUDA)
    weight = tap_major_weight(torch.randn(64, 64, 3, device=CUDA))
    with pytest.raises(ValueError, match="length"):
        conv_time_major(x, weight, None, 1, 2)
    with pytest.raises(ValueError, match="time-major"):
        conv_time_major(x.contiguous(), weight, None, 1, 1)
    with pytest.raises(ValueError, match="nothing to write"):
        conv_time_major(x, weight, None, 1, 1, write_sum=False)
