"""benchmarks/token2wav_batch.py against two trees on one machine, each side taking the first place as
often as the second: token2wav's own call times, without a server, for a change inside the engine.

    mkdir -p .gpu/base && git archive <commit> engines realtime scripts benchmarks pyproject.toml | \
        tar -x -C .gpu/base          # here; .gpu/ is ignored, carry it with the call
    bash benchmarks/on_device.sh python3 benchmarks/token2wav_ab.py .gpu/base --rounds 2 -- \
        --models /tmp/m --size full --device cuda --batches 1 16 64 --hops 15 25 --repeats 5

`--base-env` / `--head-env NAME=VALUE` (repeatable) set environment variables for one side, so BASE may be
this repository itself for an A/B of a setting (Inductor's PDL: `. --head-env TORCHINDUCTOR_ENABLE_PDL=1`;
the models' compile cache keeps such variants apart, engines/precompiled.py). `--base-arg` / `--head-arg
WORD` (repeatable) add words to one side's token2wav_batch.py arguments, for an A/B of an engine option
(HiFT's decoder in bf16: `. --head-arg=--vocoder-dtype --head-arg=bfloat16`).

Round 1 runs base then head (this repository), round 2 head then base, and so on, so that over an even
number of rounds an effect of the place cannot pass for one of the code (the DiT tail-fusion A/B's 4-5 %
at 16-64 streams reversed with the order: docs/benchmarks.md, thirtieth session). Each run's JSON goes
to --out (default $OUT, else bench-results/) as t2w-<side>-<round>.json and its table to standard output;
the summary ends with, per batch and chunk, every run's ms per call and head / base of the means.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run_order(rounds: int) -> list[tuple[int, str]]:
    """(round, side) in the order they run: base first in odd rounds, head first in even ones."""
    order: list[tuple[int, str]] = []
    for round_ in range(1, rounds + 1):
        sides = ("base", "head") if round_ % 2 else ("head", "base")
        order.extend((round_, side) for side in sides)
    return order


def summary(reports: dict[tuple[int, str], dict[str, object]]) -> str:
    """Per (batch, hop): each side's ms per call over its runs (in round order), head / base of the
    means, and each side's mean launch ms (the host queueing the call; near the call's time it includes
    waits on a full launch queue: a device-bound call, docs/benchmarks.md, thirty-fourth session)."""
    times: dict[tuple[int, int], dict[str, list[tuple[float, float]]]] = {}
    for (_, side), report in sorted(reports.items()):
        for row in report["rows"]:  # type: ignore[attr-defined]
            runs = times.setdefault((row["batch"], row["hop"]), {"base": [], "head": []})
            runs[side].append((row["ms"], row["launch_ms"]))
    lines = [f"{'streams':>7} {'hop':>4} {'base ms / call':>22} {'head ms / call':>22} {'head / base':>12} "
             f"{'launch ms base':>15} {'head':>6}"]
    for (batch, hop), sides in sorted(times.items()):
        base, head = sides["base"], sides["head"]
        ratio = (statistics.fmean(ms for ms, _ in head) / statistics.fmean(ms for ms, _ in base)
                 if base and head else float("nan"))
        launches = [statistics.fmean(launch for _, launch in runs) if runs else float("nan")
                    for runs in (base, head)]
        lines.append(f"{batch:>7} {hop:>4} {' '.join(f'{ms:.1f}' for ms, _ in base):>22} "
                     f"{' '.join(f'{ms:.1f}' for ms, _ in head):>22} {ratio:>12.3f} "
                     f"{launches[0]:>15.1f} {launches[1]:>6.1f}")
    return "\n".join(lines)


def environment(parser: argparse.ArgumentParser, assignments: list[str]) -> dict[str, str]:
    """`NAME=VALUE` words as a mapping (a word without `=` is a usage error)."""
    pairs = [word.partition("=") for word in assignments]
    for word, (name, equals, _) in zip(assignments, pairs, strict=True):
        if not name or not equals:
            parser.error(f"{word!r} is not NAME=VALUE")
    return {name: value for name, _, value in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, help="the base tree (holding benchmarks/token2wav_batch.py)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-results")))
    for side in ("base", "head"):
        parser.add_argument(f"--{side}-env", action="append", default=[], metavar="NAME=VALUE",
                            help=f"an environment variable for the {side} side's runs")
        parser.add_argument(f"--{side}-arg", action="append", default=[], metavar="WORD",
                            help=f"a word added to the {side} side's token2wav_batch.py arguments")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    batch_args = argv[split + 1:]  # token2wav_batch.py's, after --
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    if "--json" in batch_args:
        parser.error("--json is this script's to set")
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"base": args.base.resolve(), "head": HERE}
    settings = {"base": environment(parser, args.base_env), "head": environment(parser, args.head_env)}
    side_args = {"base": args.base_arg, "head": args.head_arg}
    reports: dict[tuple[int, str], dict[str, object]] = {}
    for round_, side in run_order(args.rounds):
        tree = trees[side]
        report = args.out / f"t2w-{side}-{round_}.json"
        extra = settings[side]
        named = " ".join([*(f"{name}={value}" for name, value in extra.items()), *side_args[side]])
        print(f"== round {round_}, {side}: {tree} {named}", flush=True)
        path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
        subprocess.run([sys.executable, str(tree / "benchmarks" / "token2wav_batch.py"), *batch_args,
                        *side_args[side], "--json", str(report)],
                       cwd=tree, env={**os.environ, **extra, "PYTHONPATH": path}, check=True)
        reports[(round_, side)] = json.loads(report.read_text())
    print(f"\n{summary(reports)}")


if __name__ == "__main__":
    main()
