"""Word-wide copies move exactly the bytes the element-wise ones do (engines/word_copies.py)."""

from __future__ import annotations

import pytest
import torch

from engines.word_copies import (
    WORD,
    as_words,
    cat_words,
    cat_words_into_,
    clone_words,
    copy_words_,
    gather_words,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN payloads and signed zeros count too."""
    return tensor.contiguous().view(torch.uint8)


def _integers(tensor: torch.Tensor) -> torch.Tensor:
    """The same bits as integers of the element's width: torch's float ops may rewrite a NaN's payload
    (bfloat16 on a CPU does), integer ops move bits as they are."""
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def _cache(dtype: torch.dtype, *shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(*shape, generator=generator).to(dtype)
    values.view(-1)[::7] = float("nan")  # payloads a float copy might canonicalise
    values.view(-1)[1::11] = -0.0
    return values


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_cache_row_copied_into_a_batch_slice_is_bitwise_the_same(dtype: torch.dtype) -> None:
    # (steps, depth, 2, rows, heads, frames, width), a row's frames right-aligned, as _solve_batch does.
    batch = torch.zeros(2, 3, 2, 4, 2, 9, 8, dtype=dtype)
    row = _cache(dtype, 2, 3, 2, 2, 5, 8)
    expected = batch.clone()
    expected[:, :, :, 1, :, 4:] = row
    assert as_words(batch[:, :, :, 1, :, 4:]).dtype == WORD  # the fast path is the one taken
    copy_words_(batch[:, :, :, 1, :, 4:], row)
    assert torch.equal(_bits(batch), _bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_broadcast_source_fills_every_row(dtype: torch.dtype) -> None:
    batch = torch.zeros(3, 5, 2, 7, 4, dtype=dtype)
    prompt = _cache(dtype, 3, 1, 2, 4, 4)
    expected = batch.clone()
    expected[:, 1:4, :, 2:6] = prompt
    copy_words_(batch[:, 1:4, :, 2:6], prompt)
    assert torch.equal(_bits(batch), _bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_clone_and_cat_equal_torch_bitwise(dtype: torch.dtype) -> None:
    batch = _cache(dtype, 2, 4, 3, 6, 8)
    view = batch[:, 2:3, :, 1:]
    clone = clone_words(view)
    assert clone.is_contiguous() and torch.equal(_bits(clone), _bits(view))
    newer = _cache(dtype, 2, 1, 3, 2, 8, seed=1)
    joined = cat_words((view, newer), dim=3)
    expected = torch.cat([_integers(view), _integers(newer)], dim=3)
    assert joined.dtype == dtype and torch.equal(_bits(joined), _bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_over_two_sources_equals_cat_then_gather(dtype: torch.dtype) -> None:
    # (depth, rows, heads, frames, width): own cache then chunk; each row keeps its own frames.
    own, chunk = _cache(dtype, 2, 3, 2, 5, 8), _cache(dtype, 2, 3, 2, 4, 8, seed=2)
    keep = torch.tensor([[0, 1, 6, 7, 8], [4, 5, 6, 7, 8], [2, 2, 3, 8, 0]])
    index = keep[None, :, None, :, None]
    out = torch.empty(2, 3, 2, 5, 8, dtype=dtype)
    gather_words((own, chunk), 3, index, out)
    expected = torch.gather(torch.cat([_integers(own), _integers(chunk)], dim=3), 3, index.expand(*out.shape))
    assert torch.equal(_bits(out), _bits(expected))
    alone = torch.empty(2, 3, 2, 3, 8, dtype=dtype)
    first_index = keep[:, :3].clamp(max=3)[None, :, None, :, None]
    gather_words((chunk,), 3, first_index, alone)
    expected = torch.gather(_integers(chunk), 3, first_index.expand(*alone.shape))
    assert torch.equal(_bits(alone), _bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_concatenated_into_a_batch_slice_are_bitwise_the_same(dtype: torch.dtype) -> None:
    # (layers, rows, heads, tokens, width): a run of rows' histories right-aligned, as _fill_history does.
    batch = _cache(dtype, 2, 5, 3, 9, 8, seed=3)
    histories = [_cache(dtype, 2, 1, 3, 4, 8, seed=4 + i) for i in range(3)]
    expected = _integers(batch.clone())
    expected[:, 1:4, :, 5:] = torch.cat([_integers(history) for history in histories], dim=1)
    assert as_words(batch[:, 1:4, :, 5:]).dtype == WORD  # the fast path is the one taken
    cat_words_into_(batch[:, 1:4, :, 5:], histories, dim=1)
    assert torch.equal(_bits(batch), _bits(expected))
    odd = torch.zeros(2, 3, 6, dtype=torch.float16)  # rows of 6 halves: element copies
    rows = [_cache(torch.float16, 1, 3, 6, seed=9), _cache(torch.float16, 1, 3, 6, seed=10)]
    cat_words_into_(odd, rows, dim=0)
    assert torch.equal(_bits(odd), _bits(torch.cat([_integers(row) for row in rows])))
    with pytest.raises(ValueError, match="before the last"):
        cat_words_into_(odd, rows, dim=2)


def test_layouts_without_whole_words_fall_back_to_element_copies() -> None:
    odd = _cache(torch.float16, 3, 6)  # 6 halves: not whole words
    assert as_words(odd) is odd
    shifted = _cache(torch.float16, 4, 9)[:, 1:]  # 8 halves but an offset of one element
    assert as_words(shifted) is shifted
    transposed = _cache(torch.float16, 8, 4).t()  # last dimension not contiguous
    assert as_words(transposed) is transposed
    assert as_words(_cache(torch.float64, 2, 2)).dtype == torch.float64
    destination = torch.zeros(4, 8, dtype=torch.float16)
    copy_words_(destination, shifted)
    assert torch.equal(_bits(destination), _bits(shifted))
    out = torch.empty(3, 6, dtype=torch.float16)
    with pytest.raises(ValueError, match="before the last"):
        gather_words((odd,), 1, torch.zeros(3, 6, dtype=torch.int64), out)
    assert torch.equal(_bits(cat_words((odd, odd), dim=0)), _bits(torch.cat([odd, odd])))
