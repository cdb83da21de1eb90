#!/usr/bin/env bash
# Issue #14's comparison on a machine with several GPUs (nvidia-h200-x2 or -x4), in one run:
# one GPU, then every GPU disaggregated (one LLM engine, a token2wav worker per GPU), then every GPU
# replicated (both engines per GPU). Same bench as the one-GPU figures (250 tokens per stream, all
# streams started together, simulated players); the ceiling search goes above what the GPUs can take.
#
#   bash benchmarks/wheels.sh                      # here, once: .whl/ for the GPU machine
#   bash benchmarks/multi_gpu.sh [STREAMS] [MAX]   # there, through benchmarks/on_device.sh's set-up
#
# JSON reports land in $OUT (or bench-results/): bench-1gpu.json, bench-<N>gpu-<placement>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${1:-1,64,128,256}
MAX=${2:-640}
DEST=${OUT:-bench-results}
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
mkdir -p "$DEST"
bench() {  # NAME, then server arguments
    local name=$1
    shift
    local server_args=()
    for arg in "$@" --max-streams "$MAX"; do server_args+=("--server-arg=$arg"); done
    bash benchmarks/on_device.sh python3 -m realtime bench --models "${MODELS:-/tmp/m}" --streams "$STREAMS" \
        --tokens 250 --no-baseline --search-max "$MAX" "${server_args[@]}" --json "$DEST/bench-$name.json" \
        2>&1 | tee "$DEST/bench-$name.log"
}
bench 1gpu --device cuda:0
bench "${GPUS}gpu-disaggregated" --device auto --placement disaggregated
bench "${GPUS}gpu-replicated" --device auto --placement replicated
