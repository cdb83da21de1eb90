"""Flow-matching sampler: cosine time grid, Euler steps, classifier-free guidance (MODEL_FACTS §5.3).

Each step evaluates the estimator once on a batch of 2B: the conditional half (x, mu, spks, cond) and the
unconditional half (x, 0, 0, 0); the velocity is (1 + r)·v_cond − r·v_uncond with r = `cfg_rate`.

The starting noise comes from one fixed Gaussian buffer per instance, drawn from a seeded generator, so
runs are reproducible. A solve reads the columns from the offset its caller gives (mod the buffer
length): offline frame f uses column f; a streaming chunk's offset follows the estimator-cache rule
(dit_cache.py: the reference's cache length, which stops growing once the cache is trimmed).

`solve_ragged` solves the chunks of many streams at once (`RaggedInputs`, built by batching.py): all 10
steps, no host synchronisation and no shape that depends on tensor values, so one call can be captured
as a CUDA graph (graphs.py) and write into caller-owned output buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from engines.config import MEL_BINS
from engines.word_copies import gather_words

# One step's kept keys|values: (own cache, the chunk's new frames, output) → None.
KeptFrames = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@runtime_checkable
class CachedEstimator(Protocol):
    """An estimator that can run one chunk after explicit caches (the DiT; see dit.py for the layouts)."""

    def forward_chunk(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        cnn_cache: torch.Tensor,
        att_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class PreparedMaskEstimator(Protocol):
    """An estimator whose mask takes work to turn into what its layers read (the UNet): `solve`
    prepares it once and passes the result to every step in place of the mask."""

    def prepare_mask(self, mask: torch.Tensor, dtype: torch.dtype) -> Any: ...


@runtime_checkable
class RaggedEstimator(Protocol):
    """An estimator that runs a padded batch of chunks with split prompt/own caches (dit.DiT).

    `conditioning(t)` precomputes what a step's time contributes (shared by every row);
    `ragged_layout(lengths, mask, prompt_frames, frames)` what the batch's padding implies (shared by
    every step).
    """

    def conditioning(self, t: float) -> Any: ...

    def ragged_layout(
        self, lengths: torch.Tensor, mask: torch.Tensor, prompt_frames: int, frames: int
    ) -> Any: ...

    def forward_ragged(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        spks: torch.Tensor,
        conditioning: Any,
        layout: Any,
        cnn_cache: torch.Tensor,
        prompt_kv: torch.Tensor,
        own_kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class RaggedInputs:
    """Chunks of B streams, right-padded to T frames (cond = 0: the prompts condition via the caches).

    mu (B, 80, T); spks (B, 80); offsets (B,) int64: each row's first noise column; lengths (B,) int64:
    real frames per row (≥ 1);
    cnn_cache (steps, depth, 2B, 2·hidden, 2); prompt_kv (steps, depth, 2, heads, K_p, 2·hd): the voices'
    prompt caches side by side; own_kv (steps, depth, 2B, heads, T_own, 2·hd): each row's own cached
    frames at the end (left padding); mask (2B, K_p + T_own + T) bool over [prompt, own, chunk] keys;
    keep (B, K) int64: per row, the positions in [own (T_own), chunk (T)] of the frames its own cache
    keeps after the chunk (any valid position where it keeps fewer: those outputs are not read).
    Guidance rows: conditional rows 0..B−1, then the unconditional ones in the same order.
    """

    mu: torch.Tensor
    spks: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    cnn_cache: torch.Tensor
    prompt_kv: torch.Tensor
    own_kv: torch.Tensor
    mask: torch.Tensor
    keep: torch.Tensor


@dataclass(frozen=True)
class RaggedOutputs:
    """mel (B, 80, T) right-padded; cnn_cache (steps, depth, 2B, 2·hidden, 2) after each row's last
    real frame; kept_kv (steps, depth, 2B, heads, K, 2·hd): the keys|values of [own cache, chunk] at
    each row's `keep` positions."""

    mel: torch.Tensor
    cnn_cache: torch.Tensor
    kept_kv: torch.Tensor


def cosine_time_grid(n_timesteps: int) -> tuple[float, ...]:
    """t_k = 1 − cos(π/2 · k/n), k = 0..n (small steps first)."""
    return tuple(1.0 - math.cos(math.pi / 2 * k / n_timesteps) for k in range(n_timesteps + 1))


class ConditionalCFM(nn.Module):
    """Euler solver around `estimator` (the only parameters: the checkpoint's `decoder.estimator.*`).

    `estimator(x, mask, mu, t, spks, cond) -> velocity` serves `solve` (with the mask prepared once per
    solve for a `PreparedMaskEstimator`); `solve_chunk` needs a `CachedEstimator`.
    """

    noise: torch.Tensor

    def __init__(
        self, estimator: nn.Module, n_timesteps: int, cfg_rate: float, noise_frames: int, seed: int = 0
    ) -> None:
        super().__init__()
        self.estimator = estimator
        self.n_timesteps = n_timesteps
        self.cfg_rate = cfg_rate
        generator = torch.Generator(device="cpu").manual_seed(seed)
        noise = torch.randn(1, MEL_BINS, noise_frames, generator=generator, device="cpu")
        self.register_buffer("noise", noise, persistent=False)
        self.t_grid = cosine_time_grid(n_timesteps)

    def noise_at(self, offset: int, length: int) -> torch.Tensor:
        """Noise (1, 80, length) for utterance frames [offset, offset + length)."""
        columns = (torch.arange(length, device=self.noise.device) + offset) % self.noise.shape[2]
        return self.noise[:, :, columns]

    def _guided(self, v: torch.Tensor) -> torch.Tensor:
        v_cond, v_uncond = v.chunk(2, dim=0)
        return (1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond

    def _doubled(
        self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.cat([mu, torch.zeros_like(mu)]),
            torch.cat([spks, torch.zeros_like(spks)]),
            torch.cat([cond, torch.zeros_like(cond)]),
        )

    def solve(
        self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, offset: int = 0
    ) -> torch.Tensor:
        """Mel (B, 80, T) for whole sequences whose frame 0 is utterance frame `offset`.

        mu, cond (B, 80, T); spks (B, 80); mask: the estimator's mask, (B, 1, T) or (B, T, T).
        """
        x = self.noise_at(offset, mu.shape[2]).to(mu.dtype).expand(mu.shape[0], -1, -1)
        mu2, spks2, cond2 = self._doubled(mu, spks, cond)
        estimator = self.estimator
        step_mask: Any = torch.cat([mask, mask])
        if isinstance(estimator, PreparedMaskEstimator):
            step_mask = estimator.prepare_mask(step_mask, x.dtype)
        for step in range(self.n_timesteps):
            t = torch.full((2 * x.shape[0],), self.t_grid[step], device=x.device)
            v = estimator(torch.cat([x, x]), step_mask, mu2, t, spks2, cond2)
            x = x + (self.t_grid[step + 1] - self.t_grid[step]) * self._guided(v)
        return x

    def solve_chunk(
        self,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        offset: int,
        cnn_cache: torch.Tensor,
        prefix_kv: torch.Tensor | None,
        own_kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mel (B, 80, T) of one chunk whose noise starts at column `offset`, after cached frames.

        The caches have one entry per Euler step and the guidance batch 2B (conditional rows first):
        cnn_cache (steps, depth, 2B, 2·hidden, 2); step s attends to prefix_kv[s] ⧺ own_kv[s], each
        (steps, depth, 2B, heads, T_*, 2·head_dim) (`prefix_kv` is e.g. a speaker's shared prompt).
        Returns the mel, the new cnn cache and the chunk's keys|values (steps, depth, 2B, heads, T, 2·hd).
        """
        x = self.noise_at(offset, mu.shape[2]).to(mu.dtype).expand(mu.shape[0], -1, -1)
        mu2, spks2, cond2 = self._doubled(mu, spks, cond)
        estimator = self.estimator
        if not isinstance(estimator, CachedEstimator):
            raise TypeError(f"{type(estimator).__name__} has no cached chunk mode")
        new_cnn, chunk_kv = [], []
        for step in range(self.n_timesteps):
            t = torch.full((2 * x.shape[0],), self.t_grid[step], device=x.device)
            past = own_kv[step] if prefix_kv is None else torch.cat([prefix_kv[step], own_kv[step]], dim=3)
            v, cnn, kv = estimator.forward_chunk(
                torch.cat([x, x]), mu2, t, spks2, cond2, cnn_cache[step], past
            )
            new_cnn.append(cnn)
            chunk_kv.append(kv)
            x = x + (self.t_grid[step + 1] - self.t_grid[step]) * self._guided(v)
        return x, torch.stack(new_cnn), torch.stack(chunk_kv)

    def step_conditioning(self) -> list[Any]:
        """The estimator's per-step time conditioning for `solve_ragged` (computed once, reusable)."""
        estimator = self.estimator
        if not isinstance(estimator, RaggedEstimator):
            raise TypeError(f"{type(estimator).__name__} has no ragged batch mode")
        return [estimator.conditioning(t) for t in self.t_grid[:-1]]

    def solve_ragged(
        self,
        inputs: RaggedInputs,
        out: RaggedOutputs | None = None,
        conditioning: list[Any] | None = None,
        steps: int | None = None,
    ) -> RaggedOutputs:
        """Mel of every row's chunk and the rows' new caches (see `RaggedInputs`, `RaggedOutputs`).

        `out`: buffers to write into (e.g. a CUDA graph's static outputs); None allocates them.
        conditioning: `step_conditioning()` (None computes it).
        steps: run only the first `steps` Euler steps (None: all). Every step launches the same kernels
        on the same shapes, so one step is a CUDA graph's warm-up run (what a first call compiles and
        plans), at a tenth of the device time; its outputs are then not a solution.
        """
        estimator = self.estimator
        if not isinstance(estimator, RaggedEstimator):
            raise TypeError(f"{type(estimator).__name__} has no ragged batch mode")
        if conditioning is None:
            conditioning = self.step_conditioning()
        mu, device = inputs.mu, inputs.mu.device
        frames = mu.shape[2]
        columns = (inputs.offsets[:, None] + torch.arange(frames, device=device)) % self.noise.shape[2]
        x = self.noise[0][:, columns].transpose(0, 1).to(mu.dtype)
        mu2 = torch.cat([mu, torch.zeros_like(mu)])
        spks2 = torch.cat([inputs.spks, torch.zeros_like(inputs.spks)])
        lengths2 = torch.cat([inputs.lengths, inputs.lengths])
        layout = estimator.ragged_layout(lengths2, inputs.mask, inputs.prompt_kv.shape[4], frames)
        keep = torch.cat([inputs.keep, inputs.keep])
        own_frames = inputs.own_kv.shape[4]  # (steps, depth, rows, heads, frames, 2·head_dim)
        if out is None:
            kept_size = (*inputs.own_kv.shape[:4], keep.shape[1], inputs.own_kv.shape[5])
            out = RaggedOutputs(torch.empty_like(mu), torch.empty_like(inputs.cnn_cache),
                                inputs.own_kv.new_empty(kept_size))
        keep_frames = self._kept_frames(keep, own_frames, mu.is_cuda)
        for step in range(self.n_timesteps if steps is None else steps):
            own = inputs.own_kv[step]
            v, cnn, kv = estimator.forward_ragged(
                torch.cat([x, x]), mu2, spks2, conditioning[step], layout, inputs.cnn_cache[step],
                inputs.prompt_kv[step], own,
            )
            keep_frames(own, kv, out.kept_kv[step])  # straight into the outputs
            out.cnn_cache[step].copy_(cnn)
            x = x + (self.t_grid[step + 1] - self.t_grid[step]) * self._guided(v)
        out.mel.copy_(x)
        return out

    @staticmethod
    def _kept_frames(keep: torch.Tensor, own_frames: int, cuda: bool) -> KeptFrames:
        """How a step's kept keys|values go from [own cache, chunk] at `keep`'s positions into its output."""
        if cuda:  # one kernel instead of the join and the gather (kept_frames.py); Triton: CUDA only
            from engines.token2wav.kept_frames import gather_kept_frames

            return lambda own, new, out: gather_kept_frames(own, new, keep, out)
        index = keep[None, :, None, :, None]  # over (depth, rows, heads, kept frames, ·)
        # A first chunk's history is the chunk alone (no copy of the empty cache).
        return lambda own, new, out: gather_words((new,) if own_frames == 0 else (own, new), 3, index, out)
