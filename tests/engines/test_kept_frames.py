"""The solve's kept frames in one Triton kernel (engines/token2wav/kept_frames.py) equal PyTorch's join and
gather (`word_copies.gather_words`), bit for bit."""

from __future__ import annotations

import pytest
import torch

from engines.word_copies import gather_words

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def reference(own: torch.Tensor, new: torch.Tensor, keep: torch.Tensor, out: torch.Tensor) -> None:
    index = keep[None, :, None, :, None]
    gather_words((new,) if own.shape[3] == 0 else (own, new), 3, index, out)


@pytest.mark.parametrize(
    ("own_frames", "new_frames", "kept", "width"),
    [
        (0, 30, 32, 128),  # a first chunk: the chunk alone, right-aligned in 32 kept frames
        (30, 56, 88, 128),  # a second chunk: own frames and new ones
        (200, 50, 250, 128),  # the steady state of a 4 s prompt
        (7, 5, 9, 3),  # a width that is not whole 8-byte words: element by element
    ],
)
def test_the_kernel_equals_the_join_and_gather(own_frames: int, new_frames: int, kept: int,
                                               width: int) -> None:
    generator = torch.Generator().manual_seed(own_frames + new_frames)
    depth, rows, heads = 3, 6, 4
    own = torch.randn(depth, rows, heads, own_frames, width, generator=generator).half().to(CUDA)
    new = torch.randn(depth, rows, heads, new_frames, width, generator=generator).half().to(CUDA)
    # Each row its own positions of [own, new], in any order, repeats allowed (padding rows keep 0).
    keep = torch.randint(0, own_frames + new_frames, (rows, kept), generator=generator).to(CUDA)
    keep[-1] = 0
    from engines.token2wav.kept_frames import gather_kept_frames

    got = torch.full((depth, rows, heads, kept, width), float("nan"), dtype=torch.half, device=CUDA)
    want = torch.empty_like(got)
    gather_kept_frames(own, new, keep, got)
    reference(own, new, keep, want)
    assert torch.equal(got, want)


def test_a_position_past_both_tensors_reads_zeros_and_bad_layouts_are_refused() -> None:
    from engines.token2wav.kept_frames import gather_kept_frames

    own = torch.ones(1, 2, 1, 4, 8, dtype=torch.half, device=CUDA)
    new = 2 * torch.ones(1, 2, 1, 3, 8, dtype=torch.half, device=CUDA)
    keep = torch.tensor([[0, 4, 7], [6, 3, 100]], device=CUDA)
    out = torch.full((1, 2, 1, 3, 8), 9.0, dtype=torch.half, device=CUDA)
    gather_kept_frames(own, new, keep, out)
    assert out[0, 0, 0, :, 0].tolist() == [1.0, 2.0, 0.0]
    assert out[0, 1, 0, :, 0].tolist() == [2.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="contiguous"):
        gather_kept_frames(own, new, keep, out.transpose(3, 4).contiguous().transpose(3, 4))
    with pytest.raises(ValueError, match="keep"):
        gather_kept_frames(own, new, keep[:1], out)  # one row of keep for two
