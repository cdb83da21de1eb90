"""Copies, concatenations and gathers of half-precision caches that move 8-byte words, not 2-byte elements.

A strided copy (a slice of a batch buffer, a row of a cache) is not one contiguous block, so PyTorch's
CUDA copy runs its generic elementwise kernel, one element per thread and no vector loads: for float16
that reads and writes 2 bytes at a time. On an H100 the DiT's per-stream cache copies ran at about a
twentieth of the memory's bandwidth that way (docs/benchmarks.md, fourteenth session: `aten::copy_`,
`cat` and `gather` ~85 of 395 ms of a 64-stream call). The same bytes viewed as int64 along the last
dimension (a key|value row of 128 halves is 32 words) move four times fewer elements, each a full
8-byte access. Only the view changes: the bytes copied are the same, so the result is bitwise equal.

A tensor whose last dimension is not contiguous whole words (or whose other strides or offset are not
whole words) is used as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WORD = torch.int64


def as_words(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` viewed as 8-byte words along its last dimension where its layout allows, else itself."""
    size = tensor.element_size()
    if size >= WORD.itemsize or tensor.ndim == 0 or tensor.stride(-1) != 1:
        return tensor
    ratio = WORD.itemsize // size
    if tensor.shape[-1] % ratio or tensor.storage_offset() % ratio:
        return tensor
    if any(stride % ratio for stride, length in zip(tensor.stride()[:-1], tensor.shape[:-1], strict=True)
           if length > 1):
        return tensor
    return tensor.view(WORD)


def word_views(*tensors: torch.Tensor) -> list[torch.Tensor] | None:
    """All `tensors` (one dtype) as words, or None when any cannot be: then none is, since a copy between
    a word view and an element view would convert values, not move bytes."""
    if len({tensor.dtype for tensor in tensors}) > 1:
        return None
    views = [as_words(tensor) for tensor in tensors]
    return views if all(view.dtype == WORD for view in views) else None


def copy_words_(destination: torch.Tensor, source: torch.Tensor) -> None:
    """`destination.copy_(source)` (same dtype; `source` may broadcast), moving words where it can."""
    views = word_views(destination, source) or [destination, source]
    views[0].copy_(views[1])


def clone_words(source: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `source` (as `source.clone(memory_format=torch.contiguous_format)`)."""
    copy = torch.empty(source.shape, dtype=source.dtype, device=source.device)
    copy_words_(copy, source)
    return copy


def cat_words(tensors: tuple[torch.Tensor, ...], dim: int) -> torch.Tensor:
    """`torch.cat(tensors, dim)` (one dtype, `dim` not the last), joined as words where all allow it."""
    if dim % tensors[0].ndim == tensors[0].ndim - 1:
        raise ValueError("cat_words joins along a dimension before the last")
    views = word_views(*tensors)
    if views is None:
        return torch.cat(tensors, dim=dim)
    return torch.cat(views, dim=dim).view(tensors[0].dtype)


def cat_words_into_(destination: torch.Tensor, tensors: Sequence[torch.Tensor], dim: int) -> None:
    """`torch.cat(tensors, dim, out=destination)` into a view of a larger buffer (its shape already the
    result's), moving words where all allow it: one call for many rows' copies, where each row's own
    `copy_words_` would cost the host a Python call and its views."""
    if dim % destination.ndim == destination.ndim - 1:
        raise ValueError("cat_words_into_ joins along a dimension before the last")
    *views, out = word_views(*tensors, destination) or [*tensors, destination]
    torch.cat(views, dim=dim, out=out)


def gather_words(sources: tuple[torch.Tensor, ...], dim: int, index: torch.Tensor, out: torch.Tensor) -> None:
    """`torch.gather(torch.cat(sources, dim), dim, index expanded over the last dimension, out=out)`:
    `index` has `out`'s shape but 1 in the last dimension (`dim` is not the last). Concatenated and
    gathered as words where every tensor allows it."""
    if dim % out.ndim == out.ndim - 1:
        raise ValueError("gather_words gathers along a dimension before the last")
    *views, out_view = word_views(*sources, out) or [*sources, out]
    history = views[0] if len(views) == 1 else torch.cat(views, dim=dim)
    torch.gather(history, dim, index.expand(*out_view.shape), out=out_view)
