#!/usr/bin/env bash
# First audio while the token2wav warm-up's rest still runs between calls (right after /readyz answers)
# and again once it is done, on one server (through benchmarks/on_device.sh's set-up):
#
#   bash benchmarks/on_device.sh bash benchmarks/during_warmup.sh [STREAMS]
#
# Each phase runs the STREAMS levels (bursts), then streams arriving as a Poisson process for
# ARRIVALS_S seconds (default 20) at RATE_CAPACITY/10 per second (`realtime bench --staggered 1
# --capacity RATE_CAPACITY`, default 20: 2 a second): lone requests arriving at any moment of the
# warm-up's rest, which beside open streams runs one step a second. Reports land in $OUT (or
# bench-results/): during.json / during.log (right after ready), after.json / after.log (once the
# warm-up is done), serve.log.
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${1:-1,16,64}
MODELS=${MODELS:-/tmp/m}
DEST=$(realpath -m "${OUT:-bench-results}")
PORT=${PORT:-8123}
mkdir -p "$DEST"
# Every bench stream is one socket from this one client: the per-client limits must admit them at once.
python3 -m realtime serve --models "$MODELS" --device "${DEVICE:-cuda}" --max-streams 320 --host 127.0.0.1 --port "$PORT" \
    --max-connections-per-client 640 --rate-burst 640 --rate-limit 640 >"$DEST/serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" || true' EXIT
python3 - "$PORT" "$server" <<'EOF'
import os, sys, time, httpx
port, server = int(sys.argv[1]), int(sys.argv[2])
deadline = time.monotonic() + 900
while time.monotonic() < deadline:
    try:
        os.kill(server, 0)
    except ProcessLookupError:
        sys.exit("the server exited before it was ready (serve.log says why)")
    try:
        if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.2)
else:
    sys.exit("the server was not ready in 900 s")
EOF
bench() {  # NAME
    python3 -m realtime bench --url "ws://127.0.0.1:$PORT/v1/ws" --streams "$STREAMS" --tokens 250 --no-search \
        --staggered 1 --capacity "${RATE_CAPACITY:-20}" --staggered-s "${ARRIVALS_S:-20}" \
        --json "$DEST/$1.json" 2>&1 | tee "$DEST/$1.log"
}
bench during
python3 -c "import sys; from realtime.bench_server import wait_until_warm; wait_until_warm(int(sys.argv[1]))" "$PORT"
bench after
grep -h "finished between calls\|first stage:" "$DEST/serve.log" || true
