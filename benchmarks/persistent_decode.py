"""How fast could a one-row decode step's projections go as one persistent kernel? A floor probe.

Today a layer's norms and projections are 4 kernels (engines/llm/decode_linear.py; ~22 µs a layer at
one row on an H200 against ~7 µs to read its 30 MB of weights). This probe runs all 24 layers' q|k|v
(RMSNorm folded in), o_proj, gate|up (RMSNorm, SwiGLU) and down as ONE cooperative launch of one
program per multiprocessor, the phases separated by grid-wide barriers (an atomic counter that every
program increments and then polls), and compares its time per layer with the 4 fused kernels per
layer. Attention is left out of both (o_proj reads the first 896 values of q|k|v in its place); the
decode attention kernel's own time is in `decode_kernels.py --parts attention`.

    python benchmarks/persistent_decode.py [--json out.json] [--per-sm 1 2 4] [--tile-elements 2048 4096]
                                           [--prefetch 0 1]

Without prefetch each phase's loads start only after its barrier, and the memory system idles for a
load's latency at each of the 96 barriers; `--prefetch 1` has every program ask L2 for its slice of
the next phase's weights (which no phase writes) before it waits at the barrier.

The persistent chain is checked against the same chain in PyTorch (fp32 reference, relative error),
and a barrier that spins past its bound sets a flag instead of hanging (then the figures are void).
One program per multiprocessor leaves each SM one stream of loads (latency-bound unless Triton
pipelines the loop), so the probe sweeps programs per SM (all co-resident: a cooperative launch refuses
more) and tile sizes; a configuration that does not launch is reported as such. Run with
TRITON_INTERPRET=1 and --programs 1 on a CPU, it checks the arithmetic (one program passes every
barrier alone).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.append(str(Path(__file__).resolve().parents[1]))

from engines.llm.decode_linear import DecodeLinears  # noqa: E402

LAYERS, HIDDEN, QKV, INTERMEDIATE, EPS = 24, 896, 1152, 4864, 1e-6
# A layer's phases as the kernel names their constants: (name, output columns, input positions).
PHASES = (("QKV", QKV, HIDDEN), ("O", HIDDEN, HIDDEN), ("GATE", INTERMEDIATE, HIDDEN),
          ("DOWN", HIDDEN, INTERMEDIATE))
# Polls of a barrier before it gives up (legitimate waits are a few µs); a constexpr, as compiled kernels
# may read no other globals.
MAX_SPINS = tl.constexpr(1 << 16)


@triton.jit
def _grid_barrier(counter_ptr, error_ptr, target):
    """Every program of the launch reaches here before any goes on (the counter only grows)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    spins = 0
    while (tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target) & (spins < MAX_SPINS):
        spins += 1
    if spins >= MAX_SPINS:
        tl.atomic_xchg(error_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _gemv(x_ptr, norm_ptr, w_ptr, out_ptr, residual_ptr, eps, program, programs,
          K: tl.constexpr, N: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, ADD: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's columns of x @ W^T (x RMS-normed first with NORM; silu(gate)·up with GATED, W being
    [gate | up]; added into the residual in place with ADD, else stored to out)."""
    dtype = w_ptr.dtype.element_ty
    per_program = tl.cdiv(N, programs)
    columns = program * per_program + tl.arange(0, BLOCK_N)
    real = (tl.arange(0, BLOCK_N) < per_program) & (columns < N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        if NORM:
            squares += x * x
            x = x * tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        mask = real[:, None] & (k < K)[None, :]
        weights = tl.load(w_ptr + columns[:, None] * K + k[None, :], mask=mask, other=0.0)
        acc += weights.to(tl.float32) * x[None, :]
        if GATED:
            up = tl.load(w_ptr + (columns[:, None] + N) * K + k[None, :], mask=mask, other=0.0)
            up_acc += up.to(tl.float32) * x[None, :]
    out = tl.sum(acc, 1)
    if NORM:
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
        out = out * rstd
        if GATED:
            gate = out.to(dtype).to(tl.float32)
            out = gate * tl.sigmoid(gate) * (tl.sum(up_acc, 1) * rstd).to(dtype).to(tl.float32)
    if ADD:
        previous = tl.load(residual_ptr + columns, mask=real, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(residual_ptr + columns, (previous + out).to(dtype), mask=real)
    else:
        tl.store(out_ptr + columns, out.to(dtype), mask=real)


@triton.jit
def _prefetch_slice(w_ptr, program, programs, K: tl.constexpr, N: tl.constexpr, GATED: tl.constexpr,
                    LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr):
    """Asks L2 for this program's rows of a phase's weight (as `_gemv` divides them: contiguous), one
    request per line, without waiting; the lanes past them ask for the weight's first line."""
    per_program = tl.cdiv(N, programs)
    first = program * per_program
    count = tl.minimum(per_program, N - first) * K
    offsets = tl.arange(0, LINES) * LINE_ELEMENTS
    for half in tl.static_range(2 if GATED else 1):
        base = w_ptr + (half * N + first) * K
        addresses = tl.where(offsets < count, base + offsets, w_ptr)
        tl.inline_asm_elementwise("{ prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l", [addresses],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _persistent_layers(
    residual_ptr, qkv_ptr, hidden_ptr, norms_ptr, qkv_w_ptr, o_w_ptr, gate_up_w_ptr, down_w_ptr,
    counter_ptr, error_ptr, eps, LAYER_COUNT: tl.constexpr,
    HIDDEN_SIZE: tl.constexpr, QKV_SIZE: tl.constexpr, INTER: tl.constexpr,
    QKV_BN: tl.constexpr, QKV_BK: tl.constexpr, O_BN: tl.constexpr, O_BK: tl.constexpr,
    GATE_BN: tl.constexpr, GATE_BK: tl.constexpr, DOWN_BN: tl.constexpr, DOWN_BK: tl.constexpr,
    PREFETCH: tl.constexpr, QKV_LINES: tl.constexpr, O_LINES: tl.constexpr, GATE_LINES: tl.constexpr,
    DOWN_LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr,
):
    """With PREFETCH, each program asks L2 for its slice of the next phase's weights before it waits at
    a barrier (weights do not depend on the barrier), so the memory system never idles across one."""
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    for layer in range(LAYER_COUNT):
        norm1 = norms_ptr + (2 * layer) * HIDDEN_SIZE
        norm2 = norms_ptr + (2 * layer + 1) * HIDDEN_SIZE
        qkv_w = qkv_w_ptr + layer * QKV_SIZE * HIDDEN_SIZE
        o_w = o_w_ptr + layer * HIDDEN_SIZE * HIDDEN_SIZE
        gate_up_w = gate_up_w_ptr + layer * 2 * INTER * HIDDEN_SIZE
        down_w = down_w_ptr + layer * HIDDEN_SIZE * INTER
        next_qkv_w = qkv_w_ptr + tl.minimum(layer + 1, LAYER_COUNT - 1) * QKV_SIZE * HIDDEN_SIZE
        phases = layer * 4  # barriers passed before this layer
        _gemv(residual_ptr, norm1, qkv_w, qkv_ptr, residual_ptr, eps,
              program, programs, HIDDEN_SIZE, QKV_SIZE, True, False, False, QKV_BN, QKV_BK)
        if PREFETCH:
            _prefetch_slice(o_w, program, programs, HIDDEN_SIZE, HIDDEN_SIZE, False, O_LINES, LINE_ELEMENTS)
        _grid_barrier(counter_ptr, error_ptr, (phases + 1) * programs)
        _gemv(qkv_ptr, norm1, o_w, qkv_ptr, residual_ptr, eps,
              program, programs, HIDDEN_SIZE, HIDDEN_SIZE, False, False, True, O_BN, O_BK)
        if PREFETCH:
            _prefetch_slice(gate_up_w, program, programs, HIDDEN_SIZE, INTER, True, GATE_LINES, LINE_ELEMENTS)
        _grid_barrier(counter_ptr, error_ptr, (phases + 2) * programs)
        _gemv(residual_ptr, norm2, gate_up_w, hidden_ptr, residual_ptr,
              eps, program, programs, HIDDEN_SIZE, INTER, True, True, False, GATE_BN, GATE_BK)
        if PREFETCH:
            _prefetch_slice(down_w, program, programs, INTER, HIDDEN_SIZE, False, DOWN_LINES, LINE_ELEMENTS)
        _grid_barrier(counter_ptr, error_ptr, (phases + 3) * programs)
        _gemv(hidden_ptr, norm2, down_w, hidden_ptr, residual_ptr, eps,
              program, programs, INTER, HIDDEN_SIZE, False, False, True, DOWN_BN, DOWN_BK)
        if PREFETCH:
            _prefetch_slice(next_qkv_w, program, programs, HIDDEN_SIZE, QKV_SIZE, False, QKV_LINES,
                            LINE_ELEMENTS)
        _grid_barrier(counter_ptr, error_ptr, (phases + 4) * programs)


class Weights:
    """24 layers of weights (nothing zero), stacked per kind: the persistent kernel indexes them."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.dtype = dtype

        def randn(*shape: int, scale: float, offset: float = 0.0) -> torch.Tensor:
            return (torch.randn(shape, device=device) * scale + offset).to(dtype)

        self.norms = randn(LAYERS, 2, HIDDEN, scale=0.2, offset=1.0)
        self.qkv = randn(LAYERS, QKV, HIDDEN, scale=0.05)
        self.o = randn(LAYERS, HIDDEN, HIDDEN, scale=0.05)
        self.gate_up = randn(LAYERS, 2 * INTERMEDIATE, HIDDEN, scale=0.05)
        self.down = randn(LAYERS, HIDDEN, INTERMEDIATE, scale=0.02)


def reference(weights: Weights, start: torch.Tensor) -> torch.Tensor:
    """The chain in fp32 PyTorch, rounded to the model dtype where the kernels store: rms_norm → q|k|v;
    residual += qkv[:896] @ o^T; rms_norm → silu(gate)·up; residual += hidden @ down^T."""
    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(weights.dtype).float()

    residual = start.float()
    for layer in range(LAYERS):
        normed = F.rms_norm(residual, (HIDDEN,), weights.norms[layer, 0].float(), EPS)
        qkv = rounded(normed @ weights.qkv[layer].float().t())
        residual = rounded(residual + qkv[:, :HIDDEN] @ weights.o[layer].float().t())
        normed = F.rms_norm(residual, (HIDDEN,), weights.norms[layer, 1].float(), EPS)
        gate, up = (normed @ weights.gate_up[layer].float().t()).chunk(2, dim=-1)
        gate = rounded(gate)
        hidden = rounded(gate * torch.sigmoid(gate) * rounded(up))
        residual = rounded(residual + hidden @ weights.down[layer].float().t())
    return residual


def tile(columns: int, positions: int, programs: int, elements: int) -> dict[str, int]:
    """(BN, BK) of one phase: a program's columns rounded up to a power of two, and as many input positions
    per step as keep a tile at `elements` (the accumulators stay in registers)."""
    block_n = triton.next_power_of_2(triton.cdiv(columns, programs))
    return {"BN": block_n, "BK": min(triton.next_power_of_2(positions), max(16, elements // block_n))}


def persistent(weights: Weights, residual: torch.Tensor, programs: int, elements: int, warps: int,
               prefetch: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A function launching the persistent chain on `residual` in place, its counter and error flag
    (`prefetch`: each phase's weights asked of L2 before the barrier ahead of it)."""
    device = residual.device
    qkv = torch.empty(QKV, dtype=weights.dtype, device=device)
    hidden = torch.empty(INTERMEDIATE, dtype=weights.dtype, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    error = torch.zeros(1, dtype=torch.int32, device=device)
    options: dict[str, Any] = {} if os.environ.get("TRITON_INTERPRET") else {"launch_cooperative_grid": True}
    tiles = {name: tile(columns, positions, programs, elements // (2 if name == "GATE" else 1))
             for name, columns, positions in PHASES}
    sizes = {f"{name}_{part}": size for name, parts in tiles.items() for part, size in parts.items()}
    line_elements = 128 // weights.qkv.element_size()  # a 128-byte line
    lines = {f"{name}_LINES": triton.next_power_of_2(triton.cdiv(triton.cdiv(columns, programs) * positions,
                                                                 line_elements))
             for name, columns, positions in PHASES}

    def run() -> None:
        counter.zero_()
        _persistent_layers[(programs,)](
            residual, qkv, hidden, weights.norms, weights.qkv, weights.o, weights.gate_up, weights.down,
            counter, error, EPS, LAYER_COUNT=LAYERS, HIDDEN_SIZE=HIDDEN, QKV_SIZE=QKV, INTER=INTERMEDIATE,
            **sizes, PREFETCH=prefetch, **lines, LINE_ELEMENTS=line_elements, num_warps=warps, num_stages=3,
            **options,
        )

    return run, counter, error


def fused_kernels(weights: Weights, residual: torch.Tensor) -> Any:
    """The same chain through decode_linear.py's 4 kernels per layer."""
    linears = DecodeLinears(HIDDEN, INTERMEDIATE, residual.device)
    x = residual.view(1, HIDDEN)

    def run() -> None:
        for layer in range(LAYERS):
            qkv = linears.norm_linear(x, weights.norms[layer, 0], EPS, weights.qkv[layer], None)
            linears.add_linear_(x, qkv[:, :HIDDEN], weights.o[layer])
            hidden = linears.norm_linear(x, weights.norms[layer, 1], EPS, weights.gate_up[layer], None,
                                         gated=True)
            linears.add_linear_(x, hidden, weights.down[layer])

    return run


def us_per_layer(run: Any) -> tuple[float, str]:
    """Device time of one `run()` over the layers: replays of a CUDA graph of it, or its launches where
    the graph cannot hold them (a cooperative launch in a graph needs a recent CUDA)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run()
        replay, how = graph.replay, "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        replay, how = run, "launches"
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 20 / LAYERS)
    return statistics.median(times), how


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--programs", type=int, help="programs of the launch (instead of --per-sm)")
    parser.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 4],
                        help="programs per multiprocessor (8 warps at 1, 4 warps above)")
    parser.add_argument("--tile-elements", type=int, nargs="+", default=[2048, 4096],
                        help="weights per program and loop step (the accumulator's size)")
    parser.add_argument("--prefetch", type=int, nargs="+", choices=(0, 1), default=[0, 1],
                        help="1: each phase's weights asked of L2 before the barrier ahead of it")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    # bf16 as the model on a GPU; fp16 on a CPU, where Triton's interpreter mishandles bf16.
    weights = Weights(device, torch.bfloat16 if device.type == "cuda" else torch.float16)
    start = (torch.randn(1, HIDDEN, device=device) * 2 + 0.5).to(weights.dtype)
    expected = reference(weights, start)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    launches = ([(args.programs, 8)] if args.programs else
                [(sms * per_sm, 8 if per_sm == 1 else 4) for per_sm in args.per_sm])
    results: dict[str, Any] = {"multiprocessors": sms, "weights_mb_per_layer":
                               (QKV + HIDDEN + 2 * INTERMEDIATE + INTERMEDIATE) * HIDDEN * 2 / 1e6}
    sweep = itertools.product(launches, args.tile_elements, args.prefetch)
    for (programs, warps), elements, prefetch in sweep:
        if prefetch and device.type != "cuda":
            continue  # the interpreter runs no inline PTX
        name = f"persistent_{programs}x{warps}w_tile{elements}" + ("_prefetch" if prefetch else "")
        residual = start.clone()
        run, _, error = persistent(weights, residual, programs, elements, warps, bool(prefetch))
        try:
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
        except (RuntimeError, triton.TritonError) as failure:  # too many to be co-resident, or too big
            results[name] = {"failed": str(failure)[-400:]}  # the cause ends the message
            print(json.dumps({name: results[name]}))
            continue
        figures: dict[str, Any] = {"error_vs_reference": relative_error(residual, expected),
                                   "barrier_timed_out": bool(error.item())}
        if device.type == "cuda" and not figures["barrier_timed_out"]:
            figures["us_per_layer"], figures["timed_as"] = us_per_layer(run)
            figures["barrier_timed_out"] = bool(error.item())
        results[name] = figures
        print(json.dumps({name: figures}))
    if device.type == "cuda":
        residual = start.clone()
        run = fused_kernels(weights, residual)
        run()
        figures = {"error_vs_reference": relative_error(residual, expected)}
        figures["us_per_layer"], figures["timed_as"] = us_per_layer(run)
        results["fused_4_kernels"] = figures
        print(json.dumps({"fused_4_kernels": results["fused_4_kernels"]}))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
