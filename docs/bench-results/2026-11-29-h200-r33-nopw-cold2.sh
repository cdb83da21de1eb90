#!/usr/bin/env bash
# Two cold runs of the head (8895da0), each with its own Inductor and Triton cache.
# Run as: bash benchmarks/on_device.sh bash <this file>.
set -u
for name in a b; do
  export TORCHINDUCTOR_CACHE_DIR=/tmp/ic-$name TRITON_CACHE_DIR=/tmp/ic-$name/triton
  start=$(date +%s)
  timeout 220 python3 benchmarks/first_chunk_timeline.py --models /tmp/m --repeats 3 --kernels $OUT/k-$name.txt --json $OUT/t-$name.json --batches 1 16 64 2>&1 | grep -E "device ms per part"
  echo "$name: $(( $(date +%s) - start )) s; best_config files: $(find /tmp/ic-$name -name '*.best_config' | wc -l)"
  grep -h "ms of kernels" $OUT/k-$name.txt
done
