"""Start-up time of the server: process start → /readyz answering 200 (and → its token2wav warm-up done,
which goes on between calls after ready: `warm_s`), cold and then warm.

    python3 benchmarks/startup.py --models /tmp/m --json startup.json -- --device cuda --max-streams 320

The first start runs without any compiled artifacts (the models' compile cache is removed first, and the
folders TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR name where they are set); each later start reuses
what the previous ones left beside the models, as a restart with the same models volume does
(Inductor's default folder in /tmp is cleared before every start, as a new container has it). Each
start's server log is kept next to the JSON; the JSON lists when the log lines that end the phases came
(engines loaded, LLM engine ready, token2wav warmed up) and the durations the log reports (token2wav
weights, LLM weights and graph captures, token2wav warm-up), which
overlap since the LLM engine builds while token2wav warms up.

With `--profile`, py-spy (from benchmarks/wheels.sh's wheels, through on_device.sh) samples each start
from process start to /readyz, every thread and idle ones too: the raw stacks land next to the JSON
(`-startN.prof.txt`) with benchmarks/profile_summary.py's seconds per thread and function
(`-startN-profile.txt`):

    bash benchmarks/on_device.sh python3 benchmarks/startup.py --models /tmp/m --profile -- --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from profile_summary import py_spy_record, summarise

from realtime.bench_server import spawned_process, wait_until_warm

PHASES = {  # when each phase ended, read off the log's time stamps
    "first_log": re.compile(r"compiled kernels cached|token2wav backend"),
    "engines_loaded": re.compile(r"engines loaded in"),
    "llm": re.compile(r"torch LLM engine on .* cuda graphs: (\d+)"),
    "token2wav": re.compile(r"token2wav warmed up for batches .* in ([\d.]+) s"),
    "ready": re.compile(r"runtime ready"),
}
DURATIONS = {  # seconds the log reports for parts of the phases (which may overlap)
    "bytecode_s": re.compile(r"bytecode of \d+ modules in ([\d.]+) s"),
    "token2wav_load_s": re.compile(r"token2wav \S+ loaded on \S+ in ([\d.]+) s"),
    "llm_weights_s": re.compile(r"torch LLM weights and cache ready in ([\d.]+) s"),
    "llm_graphs_s": re.compile(r"CUDA graphs captured in ([\d.]+) s"),
    "token2wav_warmup_s": re.compile(r"token2wav warmed up for batches .* in ([\d.]+) s"),
}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")
CACHE = re.compile(r"compiled kernels cached in (\S.*)$")  # the folder the start compiled into
PROFILE_HZ = 50


def py_spy_launcher(py_spy: str, out: Path) -> list[str]:
    """py-spy sampling the server it starts into `out`; interrupting it also stops the server."""
    return [*py_spy_record(py_spy, out, PROFILE_HZ), "--"]


def one_start(models: Path, serve_args: list[str], log: Path, timeout_s: float,
              launcher: Sequence[str] = ()) -> dict[str, object]:
    """Start a server (through `launcher` if given), time /readyz, read the phase marks off its log, stop
    it."""
    started = time.time()
    ready_s = None
    # A server that exits or is never ready leaves ready_s None; its log says why. SIGINT: what a
    # profiler in front of the server stops on (and the server drains on it as on SIGTERM).
    server = spawned_process(models, serve_args, log, ready_timeout_s=timeout_s, launcher=launcher,
                             stop_signal=signal.SIGINT)
    warm_s = None
    with contextlib.suppress(RuntimeError), server as (port, process):
        ready_s = time.time() - started
        wait_until_warm(port, timeout_s, process)
        warm_s = time.time() - started
    marks: dict[str, float] = {}
    durations: dict[str, float] = {}
    cache = None
    for line in log.read_text(errors="replace").splitlines():
        cache = cache or (found.group(1) if (found := CACHE.search(line)) else None)
        for name, pattern in DURATIONS.items():
            found = pattern.search(line)
            if found and name not in durations:
                durations[name] = float(found.group(1))
        stamp = STAMP.match(line)
        if stamp is None:
            continue
        at = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + int(stamp.group(2)) / 1000
        for name, pattern in PHASES.items():
            if name not in marks and pattern.search(line):
                marks[name] = round(at - started, 1)
    return {"ready_s": None if ready_s is None else round(ready_s, 1),
            "warm_s": None if warm_s is None else round(warm_s, 1), "marks_s": marks,
            "durations_s": durations, "compile_cache": cache, "log": log.name}


# Inductor's own default folder, where the service compiled until `2ac2907` without saying so (restarts
# found it warm on the same machine only). Its rule is written out rather than taken from
# torch._inductor.runtime.cache_dir_utils.default_cache_dir: importing that sets TORCHINDUCTOR_CACHE_DIR
# in this process, which the servers it starts would inherit as a folder the environment names.
INDUCTOR_TMP = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--starts", type=int, default=2, help="starts in a row (the first one cold)")
    parser.add_argument("--keep-cache", action="store_true", help="do not clear the compile cache first")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=Path("startup.json"))
    parser.add_argument("--profile", action="store_true", help="sample each start with py-spy")
    parser.add_argument("serve_args", nargs="*", help="after --: arguments of `realtime serve`")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") if args.profile else None
    if args.profile and py_spy is None:
        print("startup.py: --profile needs py-spy on PATH (benchmarks/wheels.sh, then on_device.sh)",
              file=sys.stderr)
        return 2
    if not args.keep_cache:
        # The service compiles into the folders the environment names where it names them, else beside
        # the models: a cold start clears both.
        named = [os.environ.get(variable) for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")]
        for cache in [args.models / "compile-cache", *(Path(folder) for folder in named if folder)]:
            shutil.rmtree(cache, ignore_errors=True)
    results = []
    for index in range(args.starts):
        # Every start as in a new container that keeps only the models volume: /tmp is empty.
        shutil.rmtree(INDUCTOR_TMP, ignore_errors=True)
        name = f"{args.json.stem}-start{index + 1}"
        log = args.json.with_name(f"{name}.log")
        stacks = args.json.with_name(f"{name}.prof.txt")
        launcher = py_spy_launcher(py_spy, stacks) if py_spy is not None else []
        result = one_start(args.models, args.serve_args, log, args.timeout, launcher)
        if py_spy is not None and stacks.is_file():
            summary = args.json.with_name(f"{name}-profile.txt")
            summary.write_text(summarise(stacks, PROFILE_HZ, top=40, min_s=0.5) + "\n")
            result["profile"] = summary.name
        result["cache_before"] = "none" if index == 0 and not args.keep_cache else "kept"
        results.append(result)
        print(f"start {index + 1} ({result['cache_before']} cache): ready in {result['ready_s']} s, warm-up "
              f"done in {result['warm_s']} s; "
              f"phases {result['marks_s']}; {result['durations_s']}; compiled into {result['compile_cache']}",
              flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "serve_args": args.serve_args, "starts": results}
    args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
