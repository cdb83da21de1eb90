"""Helpers for engine tests on random modules (test modules here import them: `from weights import ...`)."""

from __future__ import annotations

import torch


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention, positions and convs all move the output visibly (the
    default init of some layers barely does): matrices scaled by fan-in, norm gains near 1, the rest
    small."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if p.dim() >= 2:
                p.copy_(noise / p[0].numel() ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)
