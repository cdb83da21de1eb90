"""How long the engines' loading takes (the start's phase before the LLM graphs and the warm-up): each
run a fresh interpreter that imports the loader, then calls `realtime.engine_loader.load_engines`.

    python3 benchmarks/load_engines.py --models /tmp/cosyvoice-synthetic-tiny --runs 3 [-- device=cuda]

Arguments after `--` are string-valued `ServiceConfig` fields as `name=value` (e.g. `device=cuda`).
What a run leaves beside the models (the kept text tokenizer, compiled artifacts) stays for the next: the
first run is the cold one. Prints a table; timings go to no test.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ONE_RUN = """
import sys, time
started = time.perf_counter()
from pathlib import Path
from realtime.config import ServiceConfig
from realtime.engine_loader import load_engines
imported = time.perf_counter()
fields = dict(item.split("=", 1) for item in sys.argv[2:])
load_engines(ServiceConfig(models_dir=Path(sys.argv[1]), **fields))
print(f"{imported - started:.2f} {time.perf_counter() - imported:.2f}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("fields", nargs="*", help="after --: string ServiceConfig fields as name=value")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    print(f"{'run':>3} {'imports s':>10} {'load_engines s':>15}")
    for run in range(1, args.runs + 1):
        done = subprocess.run([sys.executable, "-c", ONE_RUN, str(args.models), *args.fields], cwd=root,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"run {run} failed: {done.stderr.strip().splitlines()[-1:]}")
        imports, loading = done.stdout.split()[-2:]
        print(f"{run:>3} {imports:>10} {loading:>15}")


if __name__ == "__main__":
    main()
