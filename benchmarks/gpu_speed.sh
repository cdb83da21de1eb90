#!/usr/bin/env bash
# Issue #13's end-to-end figures on one GPU, in one run (through benchmarks/on_device.sh's set-up):
#
#   bash benchmarks/on_device.sh bash benchmarks/gpu_speed.sh [STREAMS] [SEARCH_MAX]
#
# PARTS (default "bench offline") picks the parts, so that each fits one 10-minute device call.
# 1. `realtime bench`: all streams started together at each level (250 tokens each), the no-underrun
#    ceiling searched up to SEARCH_MAX with --max-streams SEARCH_MAX (so the search is not capped by
#    admission; SEARCH_REPEATS bursts in a row must pass at a count, default 1), staggered Poisson loads
#    at 50/80/100 % of that ceiling, and the baseline server in the same run at 1 and 16 streams.
# 2. Offline synthesis (`realtime synth --jsonl`): 64 items of 250 tokens each, token2wav batch 64
#    (SYNTH_ARGS: more `synth` flags, such as --render-hop; SYNTH_TAG: a suffix for its log's name).
# SERVE_ARGS: more `serve` flags for the bench's servers (the baseline's too), the start-up runs and
# `synth` alike (such as "--vocoder-precision float16").
# 3. (PARTS with "startup") start-up cold and restarted (benchmarks/startup.py --starts 2).
# 4. (PARTS with "tests") the GPU-marked tests under the project's pytest configuration (make test-gpu).
#
# Reports land in $OUT (or bench-results/): bench.json, bench.log, offline.log, startup.json and its
# logs, gpu-tests.log.
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${1:-1,16,64,128,256}
SEARCH_MAX=${2:-320}
MODELS=${MODELS:-/tmp/m}
DEST=${OUT:-bench-results}
mkdir -p "$DEST"
PARTS=${PARTS:-bench offline}
read -r -a serve_args <<< "${SERVE_ARGS:-}"

if [[ " $PARTS " == *" bench "* ]]; then
    python3 -m realtime bench --models "$MODELS" --streams "$STREAMS" --tokens 250 --search-max "$SEARCH_MAX" \
        --search-repeats "${SEARCH_REPEATS:-1}" \
        --staggered 0.5,0.8,1 --staggered-s 30 --baseline-streams 1,16 \
        --server-arg=--device --server-arg=cuda --server-arg=--max-streams --server-arg="$SEARCH_MAX" \
        "${serve_args[@]/#/--server-arg=}" --json "$DEST/bench.json" 2>&1 | tee "$DEST/bench.log"
fi

if [[ " $PARTS " == *" startup "* ]]; then
    python3 benchmarks/startup.py --models "$MODELS" --starts 2 --json "$DEST/startup.json" -- --device cuda \
        --max-streams "$SEARCH_MAX" "${serve_args[@]}" 2>&1 | tee "$DEST/startup.log"
fi

if [[ " $PARTS " == *" tests "* ]]; then
    make test-gpu PYTHON=python3 2>&1 | tee "$DEST/gpu-tests.log"
fi

[[ " $PARTS " == *" offline "* ]] || exit 0
items=$(mktemp -d)
python3 - "$items" <<'EOF'
import json, pathlib, sys
folder = pathlib.Path(sys.argv[1])
texts = ["The quick brown fox jumps over the lazy dog.", "Streaming speech should start at once.",
         "Every listener hears the first words in a blink."]
lines = [json.dumps({"text": texts[i % 3], "out": f"out/{i:03d}.wav"}) for i in range(64)]
(folder / "items.jsonl").write_text("\n".join(lines) + "\n")
EOF
python3 -m realtime synth --models "$MODELS" --device cuda --jsonl "$items/items.jsonl" --batch 64 \
    --max-streams 64 --fixed-length 250 --seed 0 "${serve_args[@]}" ${SYNTH_ARGS:-} 2>&1 | tee "$DEST/offline${SYNTH_TAG:-}.log"
