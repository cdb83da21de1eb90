"""Host time of a batched token2wav call's estimator-key bookkeeping (CPU only, no model).

    python3 benchmarks/estimator_keys.py                 # this checkout
    python3 benchmarks/estimator_keys.py --repo .gpu/base # another tree, for a before/after

What `DiTFlow.chunks` and `_solve_batch` ask of every row of one call (`EstimatorKeys.after_chunk`, its
`own`, `kept_positions`, `prompt`), for 64 rows through the exponential schedule's chunks (30, 50, 100,
200, 400 mel frames), under the reference cache rule (R = 100), with a 4 s and a 30 s voice prompt (200 and
1500 frames). Rows either start from one keys object (streams of one voice opened from its speaker, as
`DiTSpeaker.keys` makes them) or each from its own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

FRAMES = (30, 50, 100, 200, 400)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo.resolve()))
    from engines.token2wav.dit_cache import EstimatorKeys

    def one_call(rows: list[EstimatorKeys], frames: int) -> list[EstimatorKeys]:
        planned = [len(keys.after_chunk(frames).own) for keys in rows]
        afters = [keys.after_chunk(frames) for keys in rows]
        kept = [keys.kept_positions(after) for keys, after in zip(rows, afters, strict=True)]
        prompts = [keys.prompt for keys in rows]
        assert len(planned) == len(kept) == len(prompts)
        return afters

    print(f"{args.rows} rows per call, ms per call (median of {args.repeats}), {args.repo}")
    print(f"{'prompt frames':>13} {'rows start from':>16} " + " ".join(f"{f:>7}" for f in FRAMES))
    for prompt_frames in (200, 1500):
        for shared in (True, False):
            samples: list[list[float]] = [[] for _ in FRAMES]
            for _ in range(args.repeats):
                start = EstimatorKeys.start("reference", 100, prompt_frames)
                rows = [start if shared else EstimatorKeys.start("reference", 100, prompt_frames)
                        for _ in range(args.rows)]
                for column, frames in zip(samples, FRAMES, strict=True):
                    began = time.perf_counter()
                    rows = one_call(rows, frames)
                    column.append((time.perf_counter() - began) * 1000)
            label = "one object" if shared else "own objects"
            print(f"{prompt_frames:>13} {label:>16} "
                  + " ".join(f"{statistics.median(column):>7.2f}" for column in samples))


if __name__ == "__main__":
    main()
