"""Where the server's threads spend a burst: py-spy samples a running server during each load level only.

    python3 benchmarks/load_profile.py --models /tmp/m --streams 64 128 --out load -- --device cuda

Starts `realtime serve` (the arguments after --), waits for its warm-up to end, runs one stream, then
for each level attaches py-spy to the server (every thread, idle ones too: a thread waiting for the GIL
or for the device shows where it waits), starts that many streams together as `realtime bench` does, and
stops the sampling when they end. Per level it writes the raw stacks (`OUT/streams-N.prof.txt`),
benchmarks/profile_summary.py's seconds per thread and function (`OUT/streams-N-profile.txt`), and
prints the level's bench line. The question it answered first: why an LLM decode step took 6–8 ms while
token2wav ran beside it (1.1 ms alone) — mostly waiting for the GIL (docs/benchmarks.md, ninth session).
With `--gil` a second py-spy samples only the thread holding the GIL (`OUT/streams-N-gil.prof.txt`,
`…-gil-profile.txt`): per thread, how long it held the GIL, and where.

py-spy comes from benchmarks/wheels.sh's wheels (on_device.sh puts it on PATH); attaching needs the
permission to trace the server (root, or a ptrace scope that allows it).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from profile_summary import py_spy_record, summarise

from realtime.bench import format_level, run_level
from realtime.bench_server import spawned_process, wait_until_warm

PROFILE_HZ = 100


def sampler(py_spy: str, pid: int, out: Path, gil: bool) -> subprocess.Popen[bytes]:
    """py-spy attached to `pid`, sampling every thread (`gil`: only the one holding the GIL) into `out`
    until interrupted."""
    return subprocess.Popen([*py_spy_record(py_spy, out, PROFILE_HZ), *(["--gil"] if gil else []),
                             "--pid", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def profile_levels(url: str, pid: int, py_spy: str, streams: list[int], tokens: int, out: Path,
                         gil: bool, spread: float = 0.0) -> None:
    await run_level(url, 1, tokens, "default")  # first requests pay for lazy initialisation
    for count in streams:
        kinds = ("", "-gil") if gil else ("",)
        stacks = {kind: out / f"streams-{count}{kind}.prof.txt" for kind in kinds}
        recorders = {kind: sampler(py_spy, pid, path, kind == "-gil") for kind, path in stacks.items()}
        try:
            await asyncio.sleep(1.0)  # py-spy attaches before the burst starts
            level = await run_level(url, count, tokens, "default", spread)
        finally:
            errors = {}
            for kind, recorder in recorders.items():
                recorder.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
                errors[kind] = recorder.communicate(timeout=60)[1]
        print("\n".join(format_level(level)), flush=True)
        for kind, path in stacks.items():
            if not path.is_file():
                print(f"py-spy wrote no samples: {errors[kind].decode(errors='replace').strip()}",
                      file=sys.stderr)
                continue
            summary = out / f"streams-{count}{kind}-profile.txt"
            summary.write_text(summarise(path, PROFILE_HZ, top=40, min_s=0.05) + "\n")
            print(f"profile: {summary}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 128], help="burst levels")
    parser.add_argument("--tokens", type=int, default=250, help="speech tokens per stream")
    parser.add_argument("--tokens-spread", type=float, default=0.0,
                        help="each stream's tokens within ± this fraction of --tokens (as realtime bench)")
    parser.add_argument("--out", type=Path, default=Path("load-profile"))
    parser.add_argument("--gil", action="store_true",
                        help="also sample only the thread holding the GIL (a second py-spy)")
    parser.add_argument("serve_args", nargs="*", help="after --: arguments of `realtime serve`")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        print("load_profile.py needs py-spy on PATH (benchmarks/wheels.sh, then on_device.sh)",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with spawned_process(args.models, args.serve_args, args.out / "server.log") as (port, server):
        wait_until_warm(port, process=server)  # as `realtime bench`: no graph captures during the levels
        asyncio.run(profile_levels(f"ws://127.0.0.1:{port}/v1/ws", server.pid, py_spy, args.streams,
                                   args.tokens, args.out, args.gil, args.tokens_spread))
    return 0


if __name__ == "__main__":
    sys.exit(main())
