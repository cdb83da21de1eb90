"""Seconds per thread and per function (inclusive) in a py-spy raw profile (`py-spy record -f raw
--threads`), e.g. a server start sampled by `benchmarks/startup.py --profile`:

    python3 benchmarks/profile_summary.py restart.txt [--top 40] [--min-s 0.5]

py-spy's raw format is one line per distinct stack, `thread (id): name;frame;frame... count`, frames as
`function (file:line)`. A function counts once per sample however deep it recurses. Seconds are samples
divided by the rate; py-spy drops samples when it cannot keep up, so compare shares rather than totals.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def py_spy_record(py_spy: str, out: Path, rate: float) -> list[str]:
    """The py-spy command that samples into `out` what `summarise` reads: raw stacks per thread, idle
    threads too, without pausing the process; it writes them when interrupted. Append the target: `--`
    and a command to start, or `--pid` and a running process."""
    return [py_spy, "record", "-r", f"{rate:g}", "--nonblocking", "--idle", "--threads", "-f", "raw",
            "-o", str(out)]


def frame_name(frame: str) -> str:
    """`function (file)` without the line number, so that a function's lines add up."""
    function, _, location = frame.rpartition(" (")
    return f"{function} ({location.split(':')[0]})" if function else frame


def summarise(path: Path, rate: float, top: int, min_s: float) -> str:
    per_thread: collections.Counter[str] = collections.Counter()
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with path.open(errors="replace") as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            thread, *frames = stack.split(";")
            name = thread.split(": ", 1)[-1]
            per_thread[name] += int(count)
            for function in {frame_name(frame) for frame in frames}:
                inclusive[name][function] += int(count)
    out = [f"{path.name}: seconds sampled per thread (at {rate:g} Hz)"]
    out += [f"{n / rate:8.2f}  {name}" for name, n in per_thread.most_common()]
    for name, _ in per_thread.most_common():
        rows = [(n / rate, f) for f, n in inclusive[name].most_common(top) if n / rate >= min_s]
        if rows:
            out.append(f"\n== {name}: inclusive seconds, top {len(rows)}")
            out += [f"{seconds:8.2f}  {function}" for seconds, function in rows]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--rate", type=float, default=50.0, help="py-spy's sampling rate (-r)")
    parser.add_argument("--top", type=int, default=40, help="functions per thread")
    parser.add_argument("--min-s", type=float, default=0.5, help="leave out functions under this")
    args = parser.parse_args()
    print(summarise(args.profile, args.rate, args.top, args.min_s))


if __name__ == "__main__":
    main()
