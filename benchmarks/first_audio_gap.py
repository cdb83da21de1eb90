"""Where a burst's first audio goes between the clients and the server: per stream, from the client's
`start` to the server's session (admission), to its LLM request's submission (text cut on the loop or a
worker thread), to its first speech token on the host (the LLM's queue and prefill), to the server's
first audio (the first chunk's tokens and token2wav), to the client's first audio frame (delivery), on
one clock (CLOCK_MONOTONIC: `time.perf_counter` and `time.monotonic` read it in both processes on
Linux).

    python3 benchmarks/first_audio_gap.py --models /tmp/m --streams 16 64 -- --device cuda --max-streams 320

The server is `realtime serve` (the arguments after --) in a child process whose sessions record when
they were created and when their first audio was ready, kept in memory and written to a file once a
second by a thread of their own (a write on the event loop would release the GIL at the moments
measured). The client is `realtime bench`'s own (`run_streams`: sockets opened first, streams started
together, stream i with seed i).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

TOKENS = 250  # speech tokens per stream, as `realtime bench`
REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.append(str(REPOSITORY))

from realtime.bench import StreamResult, run_streams  # noqa: E402
from realtime.bench_server import spawned_process, wait_until_warm  # noqa: E402

# Run as the server: wraps Session to record its moments, then starts the CLI.
SERVER = """
import os, sys, threading, time
sys.path.insert(0, sys.argv[2])  # the repository this script belongs to
import realtime.session as session
# A record: [seed, created, first audio, first LLM request submitted, its first token on the loop].
records, path = {}, sys.argv[1]
first_streams, wrapped = {}, set()  # token stream id -> its record; token stream classes wrapped
created_init, emit, submit = session.Session.__init__, session.Session._emit, session.Session._submit
def init(self, *args, **kwargs):
    created_init(self, *args, **kwargs)
    records[self.session_id] = [self.request.sampling.seed, time.perf_counter(), None, None, None]
async def first_emit(self, pcm, *args, **kwargs):
    record = records.get(self.session_id)
    if record is not None and record[2] is None and pcm.size:
        record[2] = time.perf_counter()
    await emit(self, pcm, *args, **kwargs)
def wrap_first_token(cls):
    anext_ = cls.__anext__
    async def first_token(stream):
        tokens = await anext_(stream)
        record = first_streams.pop(id(stream), None)
        if record is not None:
            record[4] = time.perf_counter()
        return tokens
    cls.__anext__ = first_token
def submitted(self, index):
    stream = submit(self, index)
    record = records.get(self.session_id)
    if record is not None and index == 0:
        record[3] = time.perf_counter()
        first_streams[id(stream)] = record
        if type(stream) not in wrapped:
            wrapped.add(type(stream))
            wrap_first_token(type(stream))
    return stream
session.Session.__init__, session.Session._emit, session.Session._submit = init, first_emit, submitted
def dump():
    written = None
    while True:
        time.sleep(1.0)
        done = [r for r in list(records.values()) if r[2] is not None]
        if len(done) != written:
            written = len(done)
            with open(path + ".part", "w") as out:
                out.write(repr(done))
            os.replace(path + ".part", path)  # whole, never half written
threading.Thread(target=dump, daemon=True).start()
from realtime.cli import main
# Started as spawned_process's launcher: the arguments end with `python -m realtime serve ...`.
sys.argv = ["realtime", *sys.argv[sys.argv.index("realtime") + 1:]]
sys.exit(main())
"""


def report(streams: int, results: list[StreamResult], server: list[list[float]]) -> str:
    """The split of one burst: `results` are the bench client's streams (stream i sends seed i), `server`
    the session records created since the burst began."""
    client = {seed: (r.sent_at, r.sent_at + r.first_chunk_s) for seed, r in enumerate(results)
              if math.isfinite(r.first_chunk_s)}
    if not client:
        return f"{streams} streams: no first audio came back"
    by_seed: dict[int, tuple[float, float, float, float]] = {}
    for seed, created, audio, submitted, first_token in sorted(server, key=lambda record: record[1]):
        # A context's first text (its first session).
        by_seed.setdefault(int(seed), (created, submitted, first_token, audio))
    rows = [(sent, *by_seed[seed], received) for seed, (sent, received) in client.items() if seed in by_seed]
    if not rows:
        return f"{streams} streams: no server record matched the clients' seeds"
    t0 = min(sent for sent, *_ in rows)
    parts = {
        "start → session": [created - sent for sent, created, *_ in rows],
        "session → LLM request": [submitted - created for _, created, submitted, *_ in rows],
        "LLM request → first token": [token - submitted for _, _, submitted, token, *_ in rows],
        "first token → server audio": [audio - token for *_, token, audio, _ in rows],
        "server audio → client": [received - audio for *_, audio, received in rows],
        "start → client audio": [received - sent for sent, *_, received in rows],
        "session created (after first start)": [created - t0 for _, created, *_ in rows],
        "LLM request (after first start)": [submitted - t0 for _, _, submitted, *_ in rows],
        "first token (after first start)": [token - t0 for _, _, _, token, *_ in rows],
        "server audio (after first start)": [audio - t0 for *_, audio, _ in rows],
    }
    lines = [f"{streams} streams ({len(rows)} matched): ms p50 / mean / max"]
    for name, values in parts.items():
        ms = [v * 1000 for v in values]
        lines.append(f"  {name:38s} {statistics.median(ms):7.1f} {statistics.fmean(ms):7.1f} {max(ms):7.1f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("serve_args", nargs="*", help="after --: arguments of `realtime serve`")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        moments, script = Path(scratch) / "moments.txt", Path(scratch) / "server.py"
        script.write_text(SERVER)
        # The wrapper, as spawned_process's launcher, runs the `python -m realtime serve ...` after it.
        with spawned_process(args.models, args.serve_args, Path(scratch) / "server.log",
                             launcher=[sys.executable, str(script), str(moments), str(REPOSITORY)]
                             ) as (port, server):
            wait_until_warm(port, process=server)
            url = f"ws://127.0.0.1:{port}/v1/ws"
            asyncio.run(run_streams(url, 1, TOKENS, "default"))
            for count in args.streams:
                for _ in range(args.repeats):
                    began = time.perf_counter()
                    results = asyncio.run(run_streams(url, count, TOKENS, "default"))
                    time.sleep(2.5)  # the server's thread writes its records once a second
                    records = [r for r in ast.literal_eval(moments.read_text()) if r[1] >= began]
                    print(report(count, results, records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
