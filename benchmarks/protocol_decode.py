"""Event-loop time of turning a `/v1/ws` message into commands (`NativeDialect.decode`), per message kind.

    python3 benchmarks/protocol_decode.py                  # this checkout
    python3 benchmarks/protocol_decode.py --repo .gpu/base # another tree, for a before/after

A voice agent's turn is a start, its text and an end; each is decoded on the event loop as it arrives, so
a burst of N new streams costs N times their sum before the last one is admitted.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import timeit
from pathlib import Path

MESSAGES = {
    "start": {"type": "start", "context_id": "c1", "voice": "default", "sample_rate": 24000, "seed": 3,
              "fixed_length": 250},
    "text": {"type": "text", "context_id": "c1", "text": "Thanks for calling, how can I help you today?"},
    "end": {"type": "end", "context_id": "c1"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo.resolve()))
    from realtime.protocol.core import AgentProtocol, ProtocolLimits
    from realtime.protocol.native import NativeDialect

    dialect = NativeDialect()
    protocol = AgentProtocol(ProtocolLimits(max_contexts=8, max_pending_chars=3000, max_queued_texts=8),
                             voice_exists=lambda voice: True)
    print(f"µs per decode (median of {args.repeats} × {args.number}), {args.repo}")
    for kind, message in MESSAGES.items():
        frame = json.dumps(message)
        runs = timeit.repeat(functools.partial(dialect.decode, frame, protocol), number=args.number,
                             repeat=args.repeats)
        print(f"{kind:>6} {statistics.median(runs) / args.number * 1e6:8.1f}")


if __name__ == "__main__":
    main()
