"""How long a full garbage collection stops a started service's threads, with the start's objects frozen
(what `serve` does once ready: realtime/gc_pauses.py) and without.

    python3 benchmarks/gc_pause.py [--models DIR] [--device cuda] [--repeats 5]

Starts the runtime in this process (engines loaded, voices prepared, warmed up as `serve` does), then
times `gc.collect()` of the oldest generation `--repeats` times each way and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from pathlib import Path

from realtime.cli import default_models_dir
from realtime.config import ServiceConfig
from realtime.gc_pauses import start_objects_frozen
from realtime.runtime import Runtime


def full_collections_ms(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append(1000 * (time.perf_counter() - started))
    return times


async def measure(config: ServiceConfig, repeats: int) -> None:
    runtime = Runtime(config)
    await runtime.start()
    try:
        tracked = len(gc.get_objects())
        plain = full_collections_ms(repeats)
        with start_objects_frozen() as frozen:
            frozen_ms = full_collections_ms(repeats)
            left = len(gc.get_objects())
    finally:
        await runtime.stop(drain_timeout_s=0.0)
    print(f"{'start objects':>16} {'walked':>9} {'median ms':>10} {'max ms':>8}")
    print(f"{'collected':>16} {tracked:>9} {statistics.median(plain):>10.1f} {max(plain):>8.1f}")
    print(f"{'frozen':>16} {left:>9} {statistics.median(frozen_ms):>10.2f} {max(frozen_ms):>8.2f}")
    print(f"({frozen} objects frozen)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=None, help="models directory (default: the tiny ones)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as voices:
        config = ServiceConfig(models_dir=args.models or default_models_dir(), voices_dir=Path(voices),
                               device=args.device)
        asyncio.run(measure(config, args.repeats))


if __name__ == "__main__":
    main()
