"""Soak: N agents talk to one server for M minutes, the way the README's agents do; the server is watched.

Each agent holds one websocket (`/v1/ws`) for the whole run and speaks one context per turn (start,
text, end, wait for `done`) at a chosen output rate, with a short pause between turns. Every
`--sample-s` seconds the server process is sampled (resident memory, threads, open file descriptors,
from /proc) with its `/metrics` (active streams, errors by code), and one row is printed. The run ends
by itself after `--minutes`: agents finish their turn and close, the server is stopped (SIGTERM).

    python3 benchmarks/soak.py --agents 8 --minutes 30            # spawns a server on the tiny models
    python3 benchmarks/soak.py --url ws://127.0.0.1:8080 --pid 1234 --minutes 5

Exit status 1 when any turn failed (an error event, a dropped socket, no `done` within a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from websockets.asyncio.client import connect

from realtime.bench_server import spawned_process

TURN_TIMEOUT_S = 60.0
TEXTS = (
    "Thanks for calling. How can I help you today?",
    "Your order shipped this morning and should arrive on Thursday.",
    "Sure, I can do that. Is there anything else?",
)


@dataclass
class Tally:
    """What the agents did, all together."""

    turns: int = 0
    audio_bytes: int = 0
    errors: Counter[str] = field(default_factory=Counter)


@dataclass
class Sample:
    elapsed_s: float
    rss_mib: float
    threads: int
    fds: int
    active_streams: float
    server_errors: float
    turns: int
    client_errors: int


def proc_stats(pid: int) -> tuple[float, int, int]:
    """(resident MiB, threads, open fds) of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields["VmRSS"].split()[0])
    threads = int(fields["Threads"])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss_kib / 1024, threads, fds


def scrape(http_url: str) -> dict[str, float]:
    """The server's unlabelled samples, and errors summed over codes."""
    values: dict[str, float] = {}
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(f"{http_url}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            metric = name.split("{", 1)[0]
            if metric == "tts_errors_total":
                values["errors"] = values.get("errors", 0.0) + float(value)
            elif "{" not in name:
                values[metric] = float(value)
    return values


async def agent(index: int, ws_url: str, args: argparse.Namespace, tally: Tally, stop_at: float) -> None:
    """One socket, one context per turn, until `stop_at`."""
    loop = asyncio.get_running_loop()
    turn = 0
    try:
        async with connect(f"{ws_url}/v1/ws", max_size=None) as ws:
            while loop.time() < stop_at:
                context_id = f"a{index}-t{turn}"
                start = {"type": "start", "context_id": context_id, "sample_rate": args.rate}
                if args.fixed_length:
                    start["fixed_length"] = args.fixed_length
                await ws.send(json.dumps(start))
                text = TEXTS[(index + turn) % len(TEXTS)]
                await ws.send(json.dumps({"type": "text", "context_id": context_id, "text": text}))
                await ws.send(json.dumps({"type": "end", "context_id": context_id}))
                try:
                    async with asyncio.timeout(TURN_TIMEOUT_S):
                        while True:
                            frame = await ws.recv()
                            if isinstance(frame, bytes):
                                tally.audio_bytes += len(frame)
                                continue
                            event = json.loads(frame)
                            if event["type"] == "error":
                                tally.errors[event["code"]] += 1
                                break
                            if event["type"] == "done" and event["context_id"] == context_id:
                                tally.turns += 1
                                break
                except TimeoutError:
                    tally.errors["turn_timeout"] += 1
                turn += 1
                await asyncio.sleep(args.pause_s)
    except Exception as exc:  # a dropped socket ends this agent; the run goes on and counts it
        tally.errors[f"socket:{type(exc).__name__}"] += 1


async def sampler(pid: int | None, http_url: str, tally: Tally, stop_at: float, every_s: float,
                  samples: list[Sample]) -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    print(f"{'t (s)':>7} {'RSS MiB':>8} {'threads':>7} {'fds':>5} {'active':>6} {'srv err':>7} "
          f"{'turns':>6} {'cli err':>7}", flush=True)
    while True:
        rss, threads, fds = proc_stats(pid) if pid is not None else (float("nan"), -1, -1)
        metrics = await asyncio.to_thread(scrape, http_url)
        sample = Sample(
            elapsed_s=round(loop.time() - began, 1),
            rss_mib=round(rss, 1),
            threads=threads,
            fds=fds,
            active_streams=metrics.get("tts_active_streams", float("nan")),
            server_errors=metrics.get("errors", 0.0),
            turns=tally.turns,
            client_errors=sum(tally.errors.values()),
        )
        samples.append(sample)
        print(f"{sample.elapsed_s:>7.0f} {sample.rss_mib:>8.1f} {sample.threads:>7} {sample.fds:>5} "
              f"{sample.active_streams:>6.0f} {sample.server_errors:>7.0f} {sample.turns:>6} "
              f"{sample.client_errors:>7}", flush=True)
        if loop.time() >= stop_at:
            return
        await asyncio.sleep(min(every_s, max(0.0, stop_at - loop.time())))


async def soak(ws_url: str, pid: int | None, args: argparse.Namespace) -> tuple[Tally, list[Sample]]:
    http_url = ws_url.replace("ws", "http", 1)
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + args.minutes * 60
    tally = Tally()
    samples: list[Sample] = []
    agents = [asyncio.create_task(agent(i, ws_url, args, tally, stop_at)) for i in range(args.agents)]
    await sampler(pid, http_url, tally, stop_at, args.sample_s, samples)
    await asyncio.gather(*agents)
    await asyncio.sleep(2.0)  # the last sockets' contexts end on the server
    await sampler(pid, http_url, tally, loop.time(), args.sample_s, samples)
    return tally, samples


def summary(tally: Tally, samples: list[Sample], args: argparse.Namespace) -> dict[str, object]:
    first, last = samples[1] if len(samples) > 2 else samples[0], samples[-1]
    return {
        "agents": args.agents,
        "minutes": args.minutes,
        "rate": args.rate,
        "fixed_length": args.fixed_length,
        "turns": tally.turns,
        "audio_mib": round(tally.audio_bytes / 2**20, 1),
        "client_errors": dict(tally.errors),
        "server_errors": last.server_errors,
        "rss_mib_first_last_max": (first.rss_mib, last.rss_mib, max(s.rss_mib for s in samples)),
        "threads_first_last_max": (first.threads, last.threads, max(s.threads for s in samples)),
        "fds_first_last_max": (first.fds, last.fds, max(s.fds for s in samples)),
        "samples": [asdict(s) for s in samples],
    }


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--url", help="websocket base URL of a running server (default: spawn one)")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, to sample it")
    parser.add_argument("--models", help="models directory of the spawned server (default: tiny)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `serve` argument")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=int, default=16000, help="output sample rate of every context")
    parser.add_argument("--fixed-length", type=int, default=50, help="speech tokens per sentence (0: model)")
    parser.add_argument("--pause-s", type=float, default=0.5, help="pause between an agent's turns")
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--json", type=Path, default=Path("bench-results/soak.json"))
    parser.add_argument("--server-log", type=Path, default=Path("bench-results/soak-server.log"))
    args = parser.parse_args()
    if args.url:
        tally, samples = asyncio.run(soak(args.url.rstrip("/"), args.pid, args))
    else:
        with spawned_process(args.models, args.server_arg, args.server_log) as (port, process):
            tally, samples = asyncio.run(soak(f"ws://127.0.0.1:{port}", process.pid, args))
    report = summary(tally, samples, args)
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    return 1 if tally.errors or report["server_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
