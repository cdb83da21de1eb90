"""Every Triton kernel configuration the engines launch compiles for Hopper (sm_90), here, without a GPU.

The CPU tests run the kernels through Triton's interpreter, which accepts code its compiler refuses (a
kernel reading a plain module global failed so on a GPU, docs/benchmarks.md, twenty-seventh session).
`benchmarks/kernel_compile.py` runs the engines' own launch code against a driver that only names the
target, so every launch compiles with the engine's constexprs and options and never runs. Triton is not
one of this package's dependencies on CPU machines: the test installs it on first use into its own
folder under `.venvs/` (with `pip --target`, beside the repository's other test environments), never
into the environment the tests run in.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
TRITON = "triton==3.6.0"  # what the kernels were last checked with; on_device.sh prints the GPU image's
TRITON_SITE = REPOSITORY / ".venvs" / TRITON.replace("==", "-")
KERNELS = {"_norm_gemv_kernel", "_norm_linear_kernel", "_add_gemv_kernel", "_add_linear_kernel",
           "_split_kernel", "_sample_kernel", "_snake_kernel", "_snake_time_major_kernel",
           "_gather_kept_kernel"}


def triton_site() -> Path:
    """A folder holding Triton alone (its wheel carries ptxas), installed on first use; pytest workers
    and runs in parallel wait on one lock rather than install twice."""
    TRITON_SITE.parent.mkdir(exist_ok=True)
    complete = TRITON_SITE / "installed"
    with (TRITON_SITE.parent / f"{TRITON_SITE.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not complete.exists():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            "--no-deps", "--upgrade", "--target", str(TRITON_SITE), TRITON],
                           check=True, capture_output=True, text=True, timeout=1200)
            complete.write_text(TRITON + "\n")  # last: a half-installed folder is installed again
    return TRITON_SITE


def test_every_engine_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    site = triton_site()
    report = tmp_path / "kernels.json"
    # A cache of its own: every kernel is compiled now, none read from an earlier run.
    environment = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPOSITORY}",
                   "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    command = [sys.executable, str(REPOSITORY / "benchmarks" / "kernel_compile.py"), "--arch", "90", "--json",
               str(report)]
    done = subprocess.run(command, env=environment, cwd=REPOSITORY, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    kernels = json.loads(report.read_text())
    assert {kernel["kernel"] for kernel in kernels} == KERNELS
    # ptxas read every one of them (registers are what the table is for).
    assert all(kernel["registers"] for kernel in kernels)
    # PDL where asked, and the attention kernel only at the rows the projection kernels serve (16); the
    # sampler and Snake never.
    for kernel in kernels:
        asked = "PDL" in kernel["case"]
        if kernel["kernel"] == "_split_kernel":  # "attention, <rows> rows at <positions>[, PDL asked]"
            asked = asked and int(kernel["case"].split(", ")[1].split()[0]) <= 16
        assert kernel["pdl"] == asked, kernel
