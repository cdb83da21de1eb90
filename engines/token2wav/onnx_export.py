"""The Step-Audio2 DiT estimator → ONNX, for TensorRT (`build_engines.py export-onnx`, then `build-trt`).

Two graphs, one Euler step each, every block included, float32 (TensorRT lowers precision at build):

chunk (streaming, `DiT.forward_chunk`; the layout of the reference's TensorRT chunk engine):
  inputs  x, mu, cond (B, 80, T); t (B,); spks (B, 80);
          cnn_cache (depth, B, 2·hidden, 2); att_cache (depth, B, heads, T_cache, 2·head_dim)
  outputs velocity (B, 80, T); new_cnn_cache (depth, B, 2·hidden, 2);
          chunk_att_cache (depth, B, heads, T, 2·head_dim) — the chunk's own keys|values, which the
          flow appends to its cache (it decides what to keep).
offline (whole sequences, `DiT.forward`):
  inputs  x, mu, cond (B, 80, T); mask (B, 1, T) bool; t (B,); spks (B, 80)
  outputs velocity (B, 80, T)

B, T and T_cache are dynamic (T_cache may be 0). B counts guidance rows: 2 per stream.

Exporter: the TorchScript-based `torch.onnx.export(dynamo=False)` with `dynamic_axes`. The torch.export
based exporter (the default since torch 2.9) needs `onnxscript`, which this project does not install;
the graph has no data-dependent control flow, so tracing captures it exactly. Opset 17 (LayerNormalization).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engines.config import MEL_BINS, DiTConfig
from engines.token2wav.dit import CONV_CONTEXT, DiT

logger = logging.getLogger(__name__)

OPSET = 17
CHUNK_INPUTS = ("x", "mu", "t", "spks", "cond", "cnn_cache", "att_cache")
CHUNK_OUTPUTS = ("velocity", "new_cnn_cache", "chunk_att_cache")
OFFLINE_INPUTS = ("x", "mask", "mu", "t", "spks", "cond")
OFFLINE_OUTPUTS = ("velocity",)
# Example sizes for tracing; every one of them is a dynamic axis in the exported graph.
_EXAMPLE_BATCH, _EXAMPLE_FRAMES, _EXAMPLE_CACHE = 2, 6, 4


class _ChunkStep(nn.Module):
    def __init__(self, dit: DiT) -> None:
        super().__init__()
        self.dit = dit

    def forward(
        self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
        cnn_cache: torch.Tensor, att_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dit.forward_chunk(x, mu, t, spks, cond, cnn_cache, att_cache)


class _OfflineStep(nn.Module):
    def __init__(self, dit: DiT) -> None:
        super().__init__()
        self.dit = dit

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
        cond: torch.Tensor,
    ) -> torch.Tensor:
        return self.dit(x, mask, mu, t, spks, cond)


@dataclass(frozen=True)
class EstimatorShapes:
    """Tensor shapes of the estimator graphs for a DiT configuration (also the TensorRT profile source)."""

    cfg: DiTConfig

    def frames(self, batch: int, frames: int) -> tuple[int, int, int]:
        return batch, MEL_BINS, frames

    def cnn_cache(self, batch: int) -> tuple[int, int, int, int]:
        return self.cfg.depth, batch, 2 * self.cfg.hidden_size, CONV_CONTEXT

    def att_cache(self, batch: int, frames: int) -> tuple[int, int, int, int, int]:
        return self.cfg.depth, batch, self.cfg.num_heads, frames, 2 * self.cfg.head_dim

    def chunk_inputs(self, batch: int, frames: int, cache: int) -> dict[str, tuple[int, ...]]:
        return {
            "x": self.frames(batch, frames), "mu": self.frames(batch, frames), "t": (batch,),
            "spks": (batch, MEL_BINS), "cond": self.frames(batch, frames),
            "cnn_cache": self.cnn_cache(batch), "att_cache": self.att_cache(batch, cache),
        }

    def offline_inputs(self, batch: int, frames: int) -> dict[str, tuple[int, ...]]:
        return {
            "x": self.frames(batch, frames), "mask": (batch, 1, frames), "mu": self.frames(batch, frames),
            "t": (batch,), "spks": (batch, MEL_BINS), "cond": self.frames(batch, frames),
        }


def _examples(shapes: dict[str, tuple[int, ...]], generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    tensors = []
    for name, shape in shapes.items():
        if name == "mask":
            tensors.append(torch.ones(shape, dtype=torch.bool))
        elif name == "t":
            tensors.append(torch.rand(shape, generator=generator))
        else:
            tensors.append(torch.randn(shape, generator=generator))
    return tuple(tensors)


def _export(module: nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: tuple[str, ...],
            outputs: tuple[str, ...], dynamic_axes: dict[str, dict[int, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with warnings.catch_warnings():
        # The TorchScript exporter announces its deprecation; it is the one that works without onnxscript.
        warnings.simplefilter("ignore", DeprecationWarning)
        # Iterating over the cache tensors unrolls the blocks: their number is fixed by the architecture.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(module, args, str(tmp), dynamo=False, opset_version=OPSET, input_names=list(inputs),
                          output_names=list(outputs), dynamic_axes=dynamic_axes, do_constant_folding=True)
    tmp.replace(path)


def export_chunk_estimator(dit: DiT, path: Path) -> None:
    """Write the chunk graph of `dit` (float32 copy, eval mode) to `path`."""
    module = _ChunkStep(_float_copy(dit))
    shapes = EstimatorShapes(dit.cfg).chunk_inputs(_EXAMPLE_BATCH, _EXAMPLE_FRAMES, _EXAMPLE_CACHE)
    frames = {0: "batch", 2: "frames"}
    axes = {
        "x": frames, "mu": frames, "cond": frames, "t": {0: "batch"}, "spks": {0: "batch"},
        "cnn_cache": {1: "batch"}, "att_cache": {1: "batch", 3: "cache_frames"},
        "velocity": frames, "new_cnn_cache": {1: "batch"}, "chunk_att_cache": {1: "batch", 3: "frames"},
    }
    with torch.no_grad():
        _export(module, _examples(shapes, torch.Generator().manual_seed(0)), Path(path), CHUNK_INPUTS,
                CHUNK_OUTPUTS, axes)
    logger.info("exported the DiT chunk estimator to %s", path)


def export_offline_estimator(dit: DiT, path: Path) -> None:
    """Write the offline (whole sequence, key mask) graph of `dit` to `path`."""
    module = _OfflineStep(_float_copy(dit))
    shapes = EstimatorShapes(dit.cfg).offline_inputs(_EXAMPLE_BATCH, _EXAMPLE_FRAMES)
    frames = {0: "batch", 2: "frames"}
    axes = {
        "x": frames, "mask": frames, "mu": frames, "cond": frames, "t": {0: "batch"}, "spks": {0: "batch"},
        "velocity": frames,
    }
    with torch.no_grad():
        _export(module, _examples(shapes, torch.Generator().manual_seed(0)), Path(path), OFFLINE_INPUTS,
                OFFLINE_OUTPUTS, axes)
    logger.info("exported the DiT offline estimator to %s", path)


def _float_copy(dit: DiT) -> DiT:
    copy = DiT(dit.cfg)
    copy.load_state_dict({k: v.float() for k, v in dit.state_dict().items()})
    return copy.eval()
