"""CPU cost of the front-end stages that run per request: text normalisation and output resampling.

    python benchmarks/front_end.py [--repeat 20]

Text normalisation (engines/normalize.py) runs wherever `TextFrontend.prepare` runs (inside
`Runtime.speak`, on the event loop) and holds the GIL for its whole duration, so its per-sentence time
is time the loop stands still. Output resampling runs per audio chunk in the transports.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))

from engines.normalize import ReferenceNormalizer  # noqa: E402
from engines.resample import KAISER_BEST, SincResampler  # noqa: E402

SENTENCES = {
    "en, no digit (30 chars)": "Wait, what did you say to her?",
    "en, digits (31 chars)": "It is 10:30 am on Jan. 5, 2024.",
    "en, digits (76 chars)": "I bought 3 apples and 12 oranges for the party on Friday, then we went home.",
    "zh, no digit (12 chars)": "我们在会议室开会，请准时参加。",
    "zh, digits (22 chars)": "今天是2024年3月4日，气温25.5°C。",
    "en, 8 sentences (383 chars)": " ".join(["I bought 3 apples and 12 oranges for the party."] * 8),
}


def _median_ms(run: Callable[[], object], repeat: int) -> float:
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    start = time.perf_counter()
    normalize = ReferenceNormalizer()
    print(f"ReferenceNormalizer() load: {time.perf_counter() - start:.2f} s\n")
    print("| text | normalise (median ms) |\n|---|---|")
    for name, text in SENTENCES.items():
        print(f"| {name} | {_median_ms(functools.partial(normalize, text), args.repeat):.2f} |")

    audio = np.random.default_rng(0).standard_normal(24000 * 10).astype(np.float32) * 0.1
    pieces = np.array_split(audio, 250)  # 40 ms chunks
    print("\n| output rate | resample, ms per second of audio (40 ms chunks) |\n|---|---|")
    for rate in (8000, 16000, 22050, 44100, 48000):
        def run(rate: int = rate) -> None:
            resampler = SincResampler(24000, rate, KAISER_BEST)
            for piece in pieces:
                resampler.process(piece)
            resampler.flush()

        print(f"| {rate} | {_median_ms(run, max(1, args.repeat // 4)) / 10:.2f} |")


if __name__ == "__main__":
    main()
