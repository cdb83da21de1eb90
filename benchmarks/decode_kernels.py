"""Pieces of one LLM decode step on CUDA, measured alone: the decode attention kernel against the general
path (rope, cache write, SDPA over the masked bucket), RMSNorm eager against compiled, a layer's norms
and projections (everything but attention) through cuBLAS and the compiled elementwise kernels against
engines/llm/decode_linear.py's fused kernels (launched plainly and, on Hopper or later, with programmatic
dependent launch: `fused_pdl`), and a step's sampling and record (`SamplingSlots`) eager
against engines/llm/sampling_kernel.py at each of its warp counts. `--parts tiles` (not by default)
sweeps the tiles of one row's GEMVs and of the split-K adds (`tile_sweep_figures`); `--parts add_gemv` one
row's add GEMV alone, against the split-K kernel at one row (`add_gemv_sweep`).

    python benchmarks/decode_kernels.py --json out.json [--parts attention norm linears sampling tiles]

Each variant is captured 24 times (once per layer, each layer its own cache like the model's) in one
CUDA graph; the figure is the graph's replay time over 24 (device time, CUDA events, median of 5 runs
of 20 replays). Rows sit at random positions in the upper half of the attended bucket. The attention
check compares the kernel's output and cache with the general path's (relative error, fresh random
inputs per shape).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))

from engines.config import LLMConfig  # noqa: E402
from engines.llm import decode_linear, programmatic_launch, sampling_kernel  # noqa: E402
from engines.llm.base import SamplingParams  # noqa: E402
from engines.llm.decode_attention import decode_attention, split_length  # noqa: E402
from engines.llm.decode_linear import DecodeLinears  # noqa: E402
from engines.llm.qwen2 import (  # noqa: E402
    CacheBatch,
    LayerKernels,
    attention_mask,
    grouped_attention,
    rope_tables,
)
from engines.llm.sampling import SamplingSlots  # noqa: E402
from engines.llm.torch_runner import TorchLLMConfig  # noqa: E402

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, THETA = 24, 14, 2, 64, 896, 1e6
INTERMEDIATE, EPS = 4864, 1e-6
DTYPE, DEVICE = torch.bfloat16, torch.device("cuda")


def graph_us(step: Callable[[int], object], layers: int = LAYERS) -> float:
    """Device time of one `step(layer)`, from replays of a graph of `layers` of them."""
    for layer in range(layers):
        step(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            step(layer)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 20 / layers)
    return statistics.median(times)


def general_attention(kernels: LayerKernels, qkv: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                      kv_len: int, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The model's path for a decode row: rope in place, cache write, masked SDPA. `tables` are the rope
    tables and mask, which the model computes once per step for all layers."""
    rows = qkv.shape[0]
    qkv = qkv.unsqueeze(1)
    cos, sin, mask = tables
    kernels.rope_(qkv[:, :, : Q_HEADS + KV_HEADS], cos, sin)
    batch = CacheBatch(0, positions[:, None], kv_len)
    keys, values = batch.update(cache, qkv[:, :, Q_HEADS:], batch.row_index()).split(KV_HEADS, dim=1)
    out = grouped_attention(qkv[:, :, :Q_HEADS].transpose(1, 2), keys, values, mask)
    return out.transpose(1, 2).reshape(rows, Q_HEADS, HEAD_DIM)


def attention_figures(rows: int, kv_len: int, kernels: LayerKernels) -> dict[str, Any]:
    max_len = max(2560, kv_len + 512)
    cache = torch.randn(LAYERS, rows, 2 * KV_HEADS, max_len, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    qkv = torch.randn(rows, Q_HEADS + 2 * KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    positions = torch.randint(kv_len // 2, kv_len, (rows,), device=DEVICE)
    positions[0] = kv_len - 1
    cos, sin = rope_tables(positions[:, None], HEAD_DIM, THETA, DTYPE)
    rope = (cos[:, 0, 0], sin[:, 0, 0])
    tables = (cos, sin, attention_mask(positions[:, None], kv_len, Q_HEADS // KV_HEADS, DTYPE))
    inputs = qkv.clone()  # the general path rotates its input in place

    # Check: one layer, both paths from the same cache.
    reference_cache = cache[0].clone()
    reference = general_attention(kernels, qkv.clone(), reference_cache, positions, kv_len, tables).float()
    counters = torch.zeros(rows * KV_HEADS, dtype=torch.int32, device=DEVICE)
    out = decode_attention(qkv, rope, cache[0], 0, positions, kv_len, counters).float()
    figures: dict[str, Any] = {
        "rows": rows, "kv_len": kv_len, "auto_split_len": split_length(rows, KV_HEADS, kv_len),
        "rel_err": ((out - reference).norm() / reference.norm()).item(),
        "cache_rel_err": ((cache[0].float() - reference_cache.float()).norm()
                          / reference_cache.float().norm()).item(),
    }
    figures["general_us"] = graph_us(lambda layer: general_attention(
        kernels, inputs, cache[layer], positions, kv_len, tables))
    def sdpa_only(layer: int) -> object:
        keys, values = cache[layer, :, :, :kv_len].split(KV_HEADS, dim=1)
        return grouped_attention(qkv[:, None, :Q_HEADS].transpose(1, 2), keys, values, tables[2])

    figures["cudnn_sdpa_only_us"] = graph_us(sdpa_only)
    for split in (None, 64, 128, 256, 512, kv_len):
        if split is not None and split > kv_len:
            continue
        figures[f"kernel_split{split or 'auto'}_us"] = graph_us(functools.partial(
            lambda split, layer: decode_attention(qkv, rope, cache[layer], 0, positions, kv_len, counters,
                                                  split), split))
    return figures


def norm_figures(rows: int) -> dict[str, Any]:
    x = torch.randn(LAYERS, rows, 1, HIDDEN, device=DEVICE, dtype=DTYPE)
    weight = torch.randn(HIDDEN, device=DEVICE, dtype=DTYPE)
    compiled = torch.compile(F.rms_norm, dynamic=True, fullgraph=True)
    eager_out = F.rms_norm(x[0], (HIDDEN,), weight, 1e-6)
    compiled_out = compiled(x[0], (HIDDEN,), weight, 1e-6)
    return {
        "rows": rows,
        "rel_err": ((compiled_out.float() - eager_out.float()).norm() / eager_out.float().norm()).item(),
        "eager_us": graph_us(lambda layer: F.rms_norm(x[layer], (HIDDEN,), weight, 1e-6)),
        "compiled_us": graph_us(lambda layer: compiled(x[layer], (HIDDEN,), weight, 1e-6)),
    }


@dataclass
class LinearInputs:
    """A layer's projection weights in copies (each op cycles through enough of them to fill L2 twice
    over: 24 of o_proj's 1.6 MB would fit), the rows' residual, and fixed attention output and MLP
    hidden rows."""

    rows: int
    qkv_w: list[torch.Tensor]
    qkv_b: list[torch.Tensor]
    o_w: list[torch.Tensor]
    gate_up_w: list[torch.Tensor]
    down_w: list[torch.Tensor]
    norms: list[list[torch.Tensor]]  # the q|k|v's and gate|up's RMSNorm weights, one per copy
    attended: torch.Tensor
    hidden: torch.Tensor
    residual: torch.Tensor

    @classmethod
    def random(cls, rows: int) -> LinearInputs:
        l2_bytes = torch.cuda.get_device_properties(DEVICE).L2_cache_size

        def weights(*shape: int, scale: float = 0.05, copies: int = 0) -> list[torch.Tensor]:
            copy_bytes = torch.Size(shape).numel() * torch.finfo(DTYPE).bits // 8
            copies = copies or max(LAYERS, -(-2 * l2_bytes // copy_bytes))
            return [(torch.randn(shape, device=DEVICE) * scale).to(DTYPE) for _ in range(copies)]

        qkv_columns = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
        qkv_w, gate_up_w = weights(qkv_columns, HIDDEN), weights(2 * INTERMEDIATE, HIDDEN)
        return cls(
            rows, qkv_w, weights(qkv_columns, scale=1.0, copies=len(qkv_w)), weights(HIDDEN, HIDDEN),
            gate_up_w, weights(HIDDEN, INTERMEDIATE),
            [[(1 + torch.rand(HIDDEN, device=DEVICE)).to(DTYPE) for _ in range(len(weight))]
             for weight in (qkv_w, gate_up_w)],
            torch.randn(rows, HIDDEN, device=DEVICE, dtype=DTYPE),
            torch.randn(rows, INTERMEDIATE, device=DEVICE, dtype=DTYPE),
            torch.randn(rows, HIDDEN, device=DEVICE, dtype=DTYPE),
        )

    def copies(self, name: str) -> int:
        weights = {"qkv": self.qkv_w, "o_proj": self.o_w, "gate_up": self.gate_up_w, "down": self.down_w}
        return len(weights[name])

    def fused_ops(self, linears: DecodeLinears) -> dict[str, Callable[[int], object]]:
        return {
            "qkv": lambda layer: linears.norm_linear(self.residual, self.norms[0][layer], EPS,
                                                     self.qkv_w[layer], self.qkv_b[layer]),
            "o_proj": lambda layer: linears.add_linear_(self.residual, self.attended, self.o_w[layer]),
            "gate_up": lambda layer: linears.norm_linear(self.residual, self.norms[1][layer], EPS,
                                                         self.gate_up_w[layer], None, gated=True),
            "down": lambda layer: linears.add_linear_(self.residual, self.hidden, self.down_w[layer]),
        }


def linear_figures(rows: int, kernels: LayerKernels) -> dict[str, Any]:
    """A layer's work besides attention, op by op and in all: the general path against the fused kernels.
    Each layer has its own weights (30 MB a layer: the 24 do not fit in L2, as in the model)."""
    inputs = LinearInputs.random(rows)
    norms, residual = inputs.norms, inputs.residual
    x = residual.view(rows, 1, HIDDEN)
    linears = DecodeLinears(HIDDEN, INTERMEDIATE, DEVICE)
    general_ops: dict[str, Callable[[int], object]] = {
        "qkv": lambda layer: F.linear(kernels.rms_norm(x, norms[0][layer], EPS), inputs.qkv_w[layer],
                                      inputs.qkv_b[layer]),
        "o_proj": lambda layer: residual.addmm_(inputs.attended, inputs.o_w[layer].t()),
        "gate_up": lambda layer: kernels.silu_mul(F.linear(kernels.rms_norm(x, norms[1][layer], EPS),
                                                           inputs.gate_up_w[layer])),
        "down": lambda layer: residual.addmm_(inputs.hidden, inputs.down_w[layer].t()),
    }
    figures: dict[str, Any] = {"rows": rows}
    paths = [("general", general_ops), ("fused", inputs.fused_ops(linears))]
    if programmatic_launch.supported(DEVICE):  # the same kernels launched with PDL
        paths.append(("fused_pdl", inputs.fused_ops(DecodeLinears(HIDDEN, INTERMEDIATE, DEVICE, True))))
    for path, ops in paths:
        if path != "general" and not linears.serves(rows):
            continue
        for name, op in ops.items():
            figures[f"{path}_{name}_us"] = graph_us(op, inputs.copies(name))
        figures[f"{path}_us"] = graph_us(functools.partial(
            lambda ops, layer: [op(layer) for op in ops.values()], ops))
    return figures


# The tile sweep's candidates: one row's GEMV (BLOCK_N, BLOCK_K, warps; its K loop is unrolled, so no
# pipeline stages) and the split-K adds (BLOCK_N, BLOCK_K, warps, stages) with the programs they aim for
# and their most splits. The engine's own come first. 32 columns at 4 warps are left out: gate|up spills
# there (248-5116 bytes; benchmarks/kernel_compile.py's driver, sm_90).
# 16 warps: the add GEMV's best for down (thirtieth session), not yet tried for these.
GEMV_TILES = [(block_n, block_k, warps, 3) for block_n in (8, 16, 32) for block_k in (64, 128, 256)
              for warps in (4, 8, 16) if (block_n, warps) != (32, 4)]
# One row's add GEMV (o_proj, down): (BLOCK_N, BLOCK_K, warps); unrolled too. 2 warps ran 2-5x slower than
# 8 in the first sweep (docs/benchmarks.md, thirtieth session) and are left out.
ADD_GEMV_TILES = [(block_n, block_k, warps) for block_n in (2, 4, 8, 16) for block_k in (64, 128, 256)
                  for warps in (4, 8, 16)]
ADD_TILES = [(block_n, block_k, warps, stages, programs, splits)
             for block_n in (16, 32) for block_k in (64, 128) for warps in (4, 8) for stages in (3, 5)
             for programs in (264, 528) for splits in (8, 16)]


@contextlib.contextmanager
def module_constants(module: ModuleType, **constants: Any) -> Iterator[None]:
    """`module`'s constants (the kernels read them at each launch) set while inside, restored after."""
    before = {name: getattr(module, name) for name in constants}
    for name, value in constants.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def tile_sweep_figures() -> Iterator[dict[str, Any]]:
    """µs per call of one row's GEMV (q|k|v, gate|up) at each of GEMV_TILES, of one row's add GEMV (o_proj,
    down) at each of ADD_GEMV_TILES, and of the split-K adds at 16 rows at each of ADD_TILES, launched
    as the engine launches them (PDL where the GPU has it). A configuration that does not compile or
    run is reported with its error."""
    pdl = programmatic_launch.supported(DEVICE)
    inputs = {rows: LinearInputs.random(rows) for rows in (1, 16)}
    yield from add_gemv_sweep(inputs[1], pdl)
    engine_gemv = decode_linear.ONE_ROW_TILE
    engine_add = (*decode_linear.ADD_TILE, decode_linear.TARGET_PROGRAMS, decode_linear.MAX_SPLITS)
    for tile in dict.fromkeys([engine_gemv, *GEMV_TILES]):
        figures: dict[str, Any] = {"kernel": "gemv", "tile": tile, "engine": tile == engine_gemv}
        try:
            with module_constants(decode_linear, ONE_ROW_TILE=tile):
                ops = inputs[1].fused_ops(DecodeLinears(HIDDEN, INTERMEDIATE, DEVICE, pdl))
                for name in ("qkv", "gate_up"):
                    figures[f"{name}_us"] = graph_us(ops[name], inputs[1].copies(name))
        except Exception as exc:  # a tile this GPU cannot run (shared memory, registers)
            figures["error"] = f"{type(exc).__name__}: {exc}"[:200]
        yield figures
    for config in dict.fromkeys([engine_add, *ADD_TILES]):
        figures = {"kernel": "add", "tile": config, "engine": config == engine_add}
        try:
            with module_constants(decode_linear, ADD_TILE=config[:4], TARGET_PROGRAMS=config[4],
                                  MAX_SPLITS=config[5]):
                ops = inputs[16].fused_ops(DecodeLinears(HIDDEN, INTERMEDIATE, DEVICE, pdl))
                for name in ("o_proj", "down"):
                    figures[f"{name}_16_us"] = graph_us(ops[name], inputs[16].copies(name))
        except Exception as exc:
            figures["error"] = f"{type(exc).__name__}: {exc}"[:200]
        yield figures


def add_gemv_sweep(inputs: LinearInputs, pdl: bool) -> Iterator[dict[str, Any]]:
    """One row's o_proj and down: the split-K kernel the engine ran before `_add_gemv_kernel` (at the
    engine's ADD_TILE), then the GEMV at each of ADD_GEMV_TILES for both (`--parts add_gemv` runs this
    alone). Each GEMV's product is checked against its definition in fp32 (`<name>_error`, relative: a
    bf16 result's rounding is ~3e-3); `engine` names the projections whose tile the engine uses."""
    linears = DecodeLinears(HIDDEN, INTERMEDIATE, DEVICE, pdl)
    operands = {"o_proj": (inputs.attended, inputs.o_w), "down": (inputs.hidden, inputs.down_w)}
    split: dict[str, Any] = {"kernel": "add_split_1_row", "tile": (*decode_linear.ADD_TILE,
                             decode_linear.TARGET_PROGRAMS, decode_linear.MAX_SPLITS)}
    expected = {}
    for name, (x, weights) in operands.items():
        split[f"{name}_us"] = graph_us(functools.partial(
            lambda x, weights, layer: linears.add_split_(inputs.residual, x, weights[layer]), x, weights),
            len(weights))
        expected[name] = x.float() @ weights[0].float().t()
    yield split
    engine = {"o_proj": decode_linear.ONE_ROW_ADD_TILE_SHORT, "down": decode_linear.ONE_ROW_ADD_TILE_LONG}
    for tile in dict.fromkeys([*engine.values(), *ADD_GEMV_TILES]):
        figures: dict[str, Any] = {"kernel": "add_gemv", "tile": tile,
                                   "engine": [name for name, used in engine.items() if used == tile]}
        try:
            with module_constants(decode_linear, ONE_ROW_ADD_TILE_SHORT=tile, ONE_ROW_ADD_TILE_LONG=tile):
                for name, (x, weights) in operands.items():
                    figures[f"{name}_us"] = graph_us(functools.partial(
                        lambda x, weights, layer: linears.add_gemv_(inputs.residual, x, weights[layer]), x,
                        weights), len(weights))
                    got = linears.add_gemv_(torch.zeros_like(inputs.residual), x, weights[0]).float()
                    figures[f"{name}_error"] = ((got - expected[name]).norm() / expected[name].norm()).item()
        except Exception as exc:
            figures["error"] = f"{type(exc).__name__}: {exc}"[:200]
        yield figures


LLM = LLMConfig()
SPEECH_VOCAB, RAS_HISTORY = LLM.speech_vocab, TorchLLMConfig().ras_history


def sampling_figures(rows: int) -> dict[str, Any]:
    """µs of one step's `sample_and_record` over `rows` slots with CosyVoice2's settings (RAS on), eager
    (the uniforms compiled, as the engine had them) and fused at 4, 8 and 16 warps; logits as peaked as
    a trained model's (a few favourites per row), so RAS falls back now and then as it does in serving.
    `fused_no_ras_us`: the fused kernel at the module's warps with RAS off (the nucleus walk alone, no
    full-distribution draw), which tells the fallback's share."""
    logits = torch.randn(rows, SPEECH_VOCAB, device=DEVICE)
    logits.scatter_add_(1, torch.randint(0, 40, (rows, 6), device=DEVICE), torch.full((rows, 6), 6.0,
                                                                                       device=DEVICE))
    logits = logits.to(DTYPE)
    active = torch.ones(rows, dtype=torch.bool, device=DEVICE)
    figures: dict[str, Any] = {"rows": rows}
    for name, fused, warp_counts in (("eager", False, (0,)), ("fused", True, (4, 8, 16))):
        slots = SamplingSlots(rows, SPEECH_VOCAB, RAS_HISTORY, LLM.stop_tokens, LLM.eos_token, DEVICE,
                              compiled=not fused, fused=fused)
        slots.configure(torch.arange(rows, device=DEVICE),
                        [(SamplingParams(), 0, row) for row in range(rows)])
        for warps in warp_counts:
            key = f"{name}_{warps}w_us" if fused else f"{name}_us"
            with module_constants(sampling_kernel, NUM_WARPS=warps):  # the eager path ignores it
                figures[key] = graph_us(functools.partial(
                    lambda slots, _: slots.sample_and_record(logits, slice(0, rows), active), slots),
                    layers=1)
    plain = SamplingSlots(rows, SPEECH_VOCAB, RAS_HISTORY, LLM.stop_tokens, LLM.eos_token, DEVICE, fused=True)
    plain.configure(torch.arange(rows, device=DEVICE),
                    [(SamplingParams(use_ras=False), 0, row) for row in range(rows)])
    figures["fused_no_ras_us"] = graph_us(lambda _: plain.sample_and_record(logits, slice(0, rows), active),
                                          layers=1)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--parts", nargs="+",
                        choices=("attention", "norm", "linears", "sampling", "tiles", "add_gemv"),
                        default=["attention", "norm", "linears", "sampling"])
    args = parser.parse_args()
    torch.manual_seed(0)
    kernels = LayerKernels.compiled()
    parts: dict[str, tuple[str, Callable[[], Iterator[dict[str, Any]]]]] = {
        "attention": ("attention", lambda: (
            attention_figures(rows, kv_len, kernels)
            for rows, kv_len in ((1, 256), (1, 512), (1, 1024), (16, 512), (16, 1024), (64, 512), (64, 1024),
                                 (128, 512), (128, 1024), (128, 2048)))),
        "norm": ("rms_norm", lambda: (norm_figures(rows) for rows in (1, 16, 64, 128))),
        "linears": ("linears", lambda: (linear_figures(rows, kernels) for rows in (1, 2, 4, 8, 16, 32))),
        "sampling": ("sampling", lambda: (sampling_figures(rows) for rows in (1, 16, 64, 128))),
        "tiles": ("tiles", tile_sweep_figures),
        "add_gemv": ("add_gemv", lambda: add_gemv_sweep(LinearInputs.random(1),
                                                         programmatic_launch.supported(DEVICE))),
    }
    results: dict[str, Any] = {key: [] for key, _ in parts.values()}
    with torch.no_grad():
        for part in args.parts:
            key, measure = parts[part]
            for figures in measure():  # printed as each shape is measured
                results[key].append(figures)
                print(json.dumps(figures))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
