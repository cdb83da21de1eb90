"""The runs of benchmarks/ab_bench.sh side by side: per level, each run's p50 / p99 first chunk and where
the server says the first chunk's time went (admission to its tokens, to its audio), base and head.

    python3 benchmarks/ab_summary.py bench-results        # the folder holding ab-{base,head}-<round>.json

Prints a table; the medians over rounds close each level.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

REPORT = re.compile(r"ab-(base|head)-(\d+)\.json")


def runs(folder: Path) -> dict[str, list[dict[int, dict[str, float]]]]:
    """Per side, per round in order: level (streams) → the figures compared."""
    found: dict[str, dict[int, dict[int, dict[str, float]]]] = {"base": {}, "head": {}}
    for path in folder.iterdir():
        match = REPORT.fullmatch(path.name)
        if match is None:
            continue
        side, round_ = match.group(1), int(match.group(2))
        levels = json.loads(path.read_text())["ours"]["levels"]
        found[side][round_] = {
            level["streams"]: {
                "p50": level["first_chunk_p50_ms"],
                "p99": level["first_chunk_p99_ms"],
                "tokens": level["server"]["first_tokens_ms"],
                "audio": level["server"]["first_chunk_ms"],
                "underruns": level["underrun_streams"],
            }
            for level in levels
        }
    return {side: [rounds[r] for r in sorted(rounds)] for side, rounds in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    by_side = runs(args.folder)
    if not by_side["base"] or not by_side["head"]:
        raise SystemExit(f"no ab-base-N.json and ab-head-N.json pairs in {args.folder}")
    levels = sorted({streams for side in by_side.values() for run in side for streams in run})
    print(f"{'streams':>7} {'side':<5} {'round':>5} {'p50 first':>10} {'p99 first':>10} "
          f"{'tokens at':>10} {'audio at':>9} {'underrun':>9}")
    for streams in levels:
        for side, side_runs in by_side.items():
            p50s = []
            for round_, run in enumerate(side_runs, start=1):
                figures = run.get(streams)
                if figures is None:
                    continue
                p50s.append(figures["p50"])
                print(f"{streams:>7} {side:<5} {round_:>5} {figures['p50']:>8.0f}ms {figures['p99']:>8.0f}ms "
                      f"{figures['tokens']:>8.0f}ms {figures['audio']:>7.0f}ms {figures['underruns']:>9.0f}")
            if p50s:
                print(f"{streams:>7} {side:<5} {'med':>5} {statistics.median(p50s):>8.0f}ms")


if __name__ == "__main__":
    main()
