"""Strict checkpoint loading: a file whose names or shapes differ from the module fails loudly."""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

MAX_LISTED = 8


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not match the expected layout."""


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A flat name → tensor dict from a `torch.save` file (the released .pt layout)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt or not a PyTorch file: {exc}") from exc
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint {path} is not a flat dict of tensors")
    return dict(state)


def describe_mismatch(expected: Mapping[str, tuple[int, ...]], actual: Mapping[str, tuple[int, ...]]) -> str:
    """A message naming the first missing, unexpected and mis-shaped entries ('' when equal)."""
    missing = [k for k in expected if k not in actual]
    unexpected = [k for k in actual if k not in expected]
    shapes = [
        f"{k}: expected {list(expected[k])}, found {list(actual[k])}"
        for k in expected
        if k in actual and tuple(expected[k]) != tuple(actual[k])
    ]
    parts = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)):
        if items:
            more = f" (+{len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
            parts.append(f"{len(items)} {title}: " + "; ".join(items[:MAX_LISTED]) + more)
    return "\n  ".join(parts)


def state_shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def require_layout(expected: Mapping[str, tuple[int, ...]], actual: Mapping[str, tuple[int, ...]],
                   what: str) -> None:
    """Raise CheckpointError (`what`, then the differences) unless `actual` has exactly the names and
    shapes of `expected`."""
    problem = describe_mismatch(expected, actual)
    if problem:
        raise CheckpointError(f"{what}:\n  {problem}")


def load_strict(module: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy `state` into `module`, requiring exactly the module's names and shapes."""
    require_layout(state_shapes(module.state_dict()), state_shapes(state),
                   f"{source} does not match {type(module).__name__}")
    module.load_state_dict(state, strict=True)


def strip_prefix(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Drop `prefix` from every key that has it (e.g. `generator.` in some HiFT files)."""
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state.items()}


def read_manifest_tsv(path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """Parse a `name<TAB>[shape]` manifest (../shared/reference/checkpoints/*.tsv)."""
    entries = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        name, shape = line.split("\t")
        dims = shape.strip().strip("[]")
        entries.append((name, tuple(int(d) for d in dims.split(",") if d.strip())))
    return entries


def store_as_parts(module: nn.Module, fused: str, parts: Sequence[tuple[str, int]]) -> None:
    """Make `module`'s state dict hold its fused linear child `fused` as the separate linear layers
    `parts` (name, output features), in that order, and load it back from them.

    Saved parts are views of the fused tensors; a `keep_vars=True` state dict (what tracers such as the ONNX
    exporter read) keeps the fused parameters. Loading concatenates the parts when all of them are
    present; otherwise they stay as they are, so a strict load names what is missing.
    """
    names = [name for name, _ in parts]
    sizes = [size for _, size in parts]

    def save(_module: nn.Module, state: dict[str, Any], prefix: str, _metadata: Any) -> None:
        fused_prefix = f"{prefix}{fused}."
        if isinstance(state.get(f"{fused_prefix}weight"), nn.Parameter):
            return  # state_dict(keep_vars=True), as tracers ask: they want the parameters themselves
        # This module's entries are the newest ones; rebuild them with the parts in the fused tensor's place.
        entries = [(key, state.pop(key)) for key in [key for key in state if key.startswith(prefix)]]
        fields = {key.removeprefix(fused_prefix): value
                  for key, value in entries if key.startswith(fused_prefix)}
        written = False
        for key, value in entries:
            if not key.startswith(fused_prefix):
                state[key] = value
            elif not written:  # the parts take the place of the first fused tensor
                written = True
                for index, name in enumerate(names):
                    for field_name, tensor in fields.items():
                        state[f"{prefix}{name}.{field_name}"] = tensor.split(sizes)[index]

    def load(_module: nn.Module, state: dict[str, Any], prefix: str, *_args: Any) -> None:
        for field_name in ("weight", "bias"):
            keys = [f"{prefix}{name}.{field_name}" for name in names]
            if all(key in state for key in keys):
                state[f"{prefix}{fused}.{field_name}"] = torch.cat([state.pop(key) for key in keys])

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)
