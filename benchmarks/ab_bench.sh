#!/usr/bin/env bash
# The same `realtime bench` run against two trees on one machine, one after the other, so that the
# comparison is not between machines (burst figures move by tens of streams between them):
#
#   git worktree add .gpu/base <commit>          # here; .gpu/ is ignored, carry it with the call
#   bash benchmarks/on_device.sh bash benchmarks/ab_bench.sh .gpu/base -- --streams 1,16,64,128 \
#       --no-search --no-baseline --server-arg=--device --server-arg=cuda
#
# The base tree runs first (its server compiles what the cache lacks), then this repository; ROUNDS
# (default 1) repeats the pair, since one burst's first-chunk figures move by ~10 % between runs of the
# same code, in the order base head, head base, base head, ...: over an even number of rounds each side
# runs first as often as second, so an effect of the place (warm caches, clocks) cannot pass for one of
# the code (an engine A/B that reversed with the order: docs/benchmarks.md, thirtieth session). Each run
# writes its JSON report to $OUT (or bench-results/) as ab-base-<round>.json and ab-head-<round>.json;
# the tables go to standard output without the per-request log lines, and benchmarks/ab_summary.py
# ends with the p50 first chunk of every run per level, side by side. BASE_SERVER_ARGS / HEAD_SERVER_ARGS (words) add server options to one side, so
# BASE_TREE may be this repository itself for an A/B of an option:
#
#   BASE_SERVER_ARGS=--no-final-chunk-graphs bash benchmarks/on_device.sh bash benchmarks/ab_bench.sh . -- ...
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ] || [ "$2" != "--" ]; then
    echo "usage: $0 BASE_TREE -- BENCH_ARGS..." >&2
    exit 2
fi
BASE=$(cd "$1" && pwd)
shift 2
DEST=${OUT:-bench-results}
mkdir -p "$DEST"
MODELS=${MODELS:-/tmp/m}
QUIET='INFO realtime.session\|INFO realtime.transports\|GET /metrics\|httpx\|WebSocket /v1/ws\|connection open'
QUIET+='\|connection closed\|admitted: voice\|captured'
for round in $(seq "${ROUNDS:-1}"); do
order="base head"
if [ $((round % 2)) -eq 0 ]; then
    order="head base"
fi
for side in $order; do
    tree=$PWD
    extra=${HEAD_SERVER_ARGS:-}
    if [ "$side" = base ]; then
        tree=$BASE
        extra=${BASE_SERVER_ARGS:-}
    fi
    server_args=()
    for word in $extra; do
        server_args+=("--server-arg=$word")
    done
    echo "== $side: $(git -C "$tree" log -1 --format='%h %s' 2>/dev/null || echo "$tree") $extra"
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python3 -m realtime bench --models "$MODELS" \
        "$@" ${server_args[@]+"${server_args[@]}"} --json "$DEST/ab-$side-$round.json" 2>&1 | grep -v "$QUIET")
done
done
python3 benchmarks/ab_summary.py "$DEST"
