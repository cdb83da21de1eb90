#!/usr/bin/env bash
# Where a server start spends its time: a cold start (compile cache removed) and then a restart, each
# sampled by py-spy from process start to /readyz (every thread, idle ones too, 50 Hz), summarised per
# thread by benchmarks/profile_summary.py.
#
#   bash benchmarks/on_device.sh bash benchmarks/startup_profile.sh [serve args...]
#
# py-spy comes from .whl/ (benchmarks/wheels.sh) through on_device.sh. Reports in $OUT (or
# bench-results/): {cold,restart}.txt (raw stacks), .log (server logs), -summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=${MODELS:-/tmp/m}
DEST=${OUT:-bench-results}
PORT=${PORT:-8123}
mkdir -p "$DEST"
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
[ -x "$SPY" ] || { echo "py-spy not found (benchmarks/wheels.sh, then on_device.sh)" >&2; exit 1; }
serve_args=("$@")
[ ${#serve_args[@]} -gt 0 ] || serve_args=(--device cuda --max-streams 320)
rm -rf "$MODELS/compile-cache"
for run in cold restart; do
    started=$(date +%s.%N)
    "$SPY" record -r 50 --nonblocking --idle --threads -f raw -o "$DEST/$run.txt" -- \
        python3 -m realtime serve --models "$MODELS" --port "$PORT" "${serve_args[@]}" > "$DEST/$run.log" 2>&1 &
    spy=$!
    until curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1; do
        kill -0 "$spy" 2>/dev/null || { echo "$run: the server exited before it was ready" >&2; exit 1; }
        sleep 0.25
    done
    echo "$run: ready after $(python3 -c "import time; print(round(time.time() - $started, 1))") s (sampled)"
    pkill -INT -f "realtime serve --models $MODELS --port $PORT" || true
    wait "$spy" || true
    python3 benchmarks/profile_summary.py "$DEST/$run.txt" > "$DEST/$run-summary.txt"
done
