"""The project's Triton kernels compiled for a GPU architecture on a machine without one: whether each
configuration the engines launch compiles, and its registers, spills and shared memory (`ptxas -v`).

    python3 benchmarks/kernel_compile.py [--arch 90] [--json out.json]

The engines' own host functions (`DecodeLinears`, `decode_attention`, the fused sampler through
`SamplingSlots`, HiFT's `snake`, the DiT solve's `gather_kept_frames`) run on CPU tensors while Triton's
driver is replaced by one that only names the target: every launch compiles with the constexprs and
options the engine would use, and returns without running. Triton's interpreter, which the CPU tests
use, accepts code its compiler refuses (a kernel reading a plain module global failed this way on the
GPU, docs/benchmarks.md, twenty-seventh session): run this before a device call, and to see what a tile
change does to registers and spills. Needs the triton package (CUDA builds of torch bring it; elsewhere
`pip install --target DIR triton` and DIR on PYTHONPATH; its wheel carries ptxas).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

sys.path.append(str(Path(__file__).resolve().parents[1]))

from engines.config import LLMConfig  # noqa: E402
from engines.llm.decode_attention import DecodeAttention  # noqa: E402
from engines.llm.decode_linear import MAX_ROWS, DecodeLinears  # noqa: E402
from engines.llm.sampling import SamplingSlots  # noqa: E402
from engines.llm.torch_runner import TorchLLMConfig  # noqa: E402
from engines.token2wav.kept_frames import gather_kept_frames  # noqa: E402
from engines.token2wav.snake import residual_snake, snake  # noqa: E402

CPU = torch.device("cpu")
LLM = LLMConfig()  # CosyVoice2's, with its Qwen2
HIDDEN, INTERMEDIATE, HEAD_DIM = LLM.qwen.hidden_size, LLM.qwen.intermediate_size, LLM.qwen.head_dim
Q_HEADS, KV_HEADS = LLM.qwen.num_heads, LLM.qwen.num_kv_heads
QKV = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
RAS_HISTORY = TorchLLMConfig().ras_history


class CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: names the target, device 0 and stream 0, and nothing else, so
    that a launch can compile but never run."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def compile_only(target: GPUTarget) -> Iterator[list[tuple[str, Any]]]:
    """Within: every Triton launch compiles for `target` and returns its compiled kernel unrun; yields a
    list that receives the (kernel name, compiled kernel) of each launch. The driver stays replaced
    afterwards (this process has no GPU to give back to)."""
    launched: list[tuple[str, Any]] = []
    run = JITFunction.run

    def compile_instead(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        launched.append((self.fn.__name__, kernel))
        return kernel

    driver.set_active(CompileOnlyDriver(target))  # type: ignore[arg-type]
    JITFunction.run = compile_instead  # type: ignore[method-assign]
    try:
        yield launched
    finally:
        JITFunction.run = run  # type: ignore[method-assign]


@dataclass
class KernelReport:
    case: str
    kernel: str
    warps: int
    pdl: bool  # launched with programmatic dependent launch
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    shared_bytes: int


PTXAS_FIGURES = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def ptxas_figures(ptx: str) -> dict[str, int | None]:
    """Registers and spill bytes that ptxas reports for a kernel's PTX (None where it cannot run)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    arch = re.search(r"^\.target (\S+)", ptx, re.MULTILINE)
    if not ptxas.is_file() or arch is None:
        return dict.fromkeys(PTXAS_FIGURES)
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        command = [str(ptxas), "-v", f"--gpu-name={arch.group(1)}", str(source), "-o",
                   str(Path(folder) / "kernel.cubin")]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    report = done.stdout + done.stderr
    return {name: int(found.group(1)) if (found := pattern.search(report)) else None
            for name, pattern in PTXAS_FIGURES.items()}


def bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.bfloat16)


def linear_cases() -> Iterator[tuple[str, Callable[[], object]]]:
    """A layer's four projections at one row (the GEMV) and at 16 (tl.dot), plainly and with PDL."""
    norm = torch.ones(HIDDEN, dtype=torch.bfloat16)
    for rows, programmatic in ((1, False), (1, True), (16, False), (16, True)):
        linears = DecodeLinears(HIDDEN, INTERMEDIATE, CPU, programmatic)
        residual = bf16(rows, HIDDEN)
        label = f"{rows} row{'s' if rows > 1 else ''}{', PDL' if programmatic else ''}"
        yield f"q|k|v, {label}", partial(linears.norm_linear, residual, norm, 1e-6, bf16(QKV, HIDDEN),
                                         bf16(QKV))
        yield f"o_proj, {label}", partial(linears.add_linear_, residual, bf16(rows, HIDDEN),
                                          bf16(HIDDEN, HIDDEN))
        yield f"gate|up, {label}", partial(linears.norm_linear, residual, norm, 1e-6,
                                           bf16(2 * INTERMEDIATE, HIDDEN), None, gated=True)
        yield f"down, {label}", partial(linears.add_linear_, residual, bf16(rows, INTERMEDIATE),
                                        bf16(HIDDEN, INTERMEDIATE))


def attention_cases() -> Iterator[tuple[str, Callable[[], object]]]:
    """The decode attention kernel at the decode buckets' shapes, as the torch engine builds it on Hopper
    (PDL asked for, at the rows the projection kernels serve) and plainly."""
    for programmatic in (True, False):
        attention = DecodeAttention(128, KV_HEADS, CPU, programmatic, programmatic_max_rows=MAX_ROWS)
        for rows, kv_len in ((1, 256), (16, 512), (17, 512), (64, 1024), (128, 1024)):
            qkv = bf16(rows, Q_HEADS + 2 * KV_HEADS, HEAD_DIM)
            rope = (bf16(rows, HEAD_DIM), bf16(rows, HEAD_DIM))
            cache = bf16(rows, 2 * KV_HEADS, kv_len, HEAD_DIM)
            positions = torch.zeros(rows, dtype=torch.int64)
            yield (f"attention, {rows} rows at {kv_len}{', PDL asked' if programmatic else ''}",
                   partial(attention, qkv, rope, cache, 0, positions, kv_len))


def sampling_cases() -> Iterator[tuple[str, Callable[[], object]]]:
    """The fused sampler (one program per row; its shape does not depend on the rows)."""
    rows = 16
    slots = SamplingSlots(rows, LLM.speech_vocab, RAS_HISTORY, LLM.stop_tokens, LLM.eos_token, CPU,
                          fused=True)
    active = torch.ones(rows, dtype=torch.bool)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros(rows, LLM.speech_vocab, dtype=dtype)
        yield (f"sampling, {str(dtype).removeprefix('torch.')} logits",
               partial(slots.sample_and_record, logits, slice(0, rows), active))


def snake_cases() -> Iterator[tuple[str, Callable[[], object]]]:
    """HiFT's Snake, channel-major and time-major, with row ends (a padded batch) and without; the
    residual block's fused steps (a convolution's bias added, the residual add with or without the next
    Snake); in float32 and in the halves of a half-precision decoder."""
    channels, length = 512, 256
    alpha, bias = torch.ones(channels), torch.zeros(channels)
    ends = torch.full((2,), length, dtype=torch.int64)
    yield "snake, channel-major", partial(snake, torch.zeros(2, channels, length), alpha)
    time_major = torch.zeros(2, length, channels).transpose(1, 2)
    yield "snake, time-major, row ends", partial(snake, time_major, alpha, ends)
    yield "snake of a biased output, row ends", partial(snake, time_major, alpha, ends, bias)
    yield ("residual + bias + snake, row ends",
           partial(residual_snake, time_major, bias, time_major, alpha, ends))
    yield "residual + bias", partial(residual_snake, time_major, bias, time_major, None)
    # A half-precision decoder's (hift.HiFTGenerator.use_decoder_dtype): loads and stores in the half.
    half, half_alpha = time_major.to(torch.bfloat16), alpha.to(torch.bfloat16)
    yield ("bf16 residual + bias + snake, row ends",
           partial(residual_snake, half, bias.to(torch.bfloat16), half, half_alpha, ends))
    yield "fp16 snake, channel-major", partial(snake, torch.zeros(2, channels, length).half(), alpha.half())


def kept_frames_cases() -> Iterator[tuple[str, Callable[[], object]]]:
    """The DiT solve's kept frames (a step's own cache and new keys|values), as words and as halves."""
    for width, label in ((128, "words"), (3, "halves")):
        own = torch.zeros(16, 8, 8, 30, width, dtype=torch.half)
        new = torch.zeros(16, 8, 8, 56, width, dtype=torch.half)
        out = torch.zeros(16, 8, 8, 86, width, dtype=torch.half)
        keep = torch.zeros(8, 86, dtype=torch.int64)
        yield f"kept frames, {label}", partial(gather_kept_frames, own, new, keep, out)


CASES = {"linears": linear_cases, "attention": attention_cases, "sampling": sampling_cases,
         "kept frames": kept_frames_cases,
         "snake": snake_cases}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability ×10 (90: Hopper)")
    parser.add_argument("--parts", nargs="+", choices=tuple(CASES), default=list(CASES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    reports: list[KernelReport] = []
    failures = 0
    print(f"{'case':<38} {'kernel':<26} {'warps':>5} {'PDL':>3} {'regs':>5} {'spill st/ld':>11} "
          f"{'shared':>7}")
    with compile_only(GPUTarget("cuda", args.arch, 32)) as launched, torch.no_grad():
        for case, call in (case for part in args.parts for case in CASES[part]()):
            launched.clear()
            try:
                call()
            except Exception as failure:  # the compiler's message ends with the cause
                failures += 1
                print(f"{case:<38} FAILED: {str(failure)[-300:]}")
                continue
            for name, kernel in launched:
                figures = ptxas_figures(kernel.asm["ptx"])
                report = KernelReport(case, name, kernel.metadata.num_warps, bool(kernel.metadata.launch_pdl),
                                      figures["registers"], figures["spill_stores"], figures["spill_loads"],
                                      kernel.metadata.shared)
                reports.append(report)
                spills = f"{report.spill_stores}/{report.spill_loads}"
                print(f"{case:<38} {name:<26} {report.warps:>5} {'yes' if report.pdl else 'no':>3} "
                      f"{report.registers!s:>5} {spills:>11} {report.shared_bytes:>7}")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(report) for report in reports], indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
