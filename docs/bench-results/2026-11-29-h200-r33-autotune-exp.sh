#!/usr/bin/env bash
# Run as: bash benchmarks/on_device.sh bash <this file> (from .gpu/ in the thirty-fourth session, at 7ade283).
# Cold runs of first_chunk_timeline with separate Inductor caches: default vs pointwise autotuning off vs 1-stream-only warm-up.
set -u
one() {
  name=$1; shift; pw=$1; shift
  export TORCHINDUCTOR_CACHE_DIR=/tmp/ic-$name TRITON_CACHE_DIR=/tmp/ic-$name/triton
  start=$(date +%s)
  timeout 240 python3 -c "
import runpy, sys
import torch._inductor.config as c
c.triton.autotune_pointwise = $pw
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
" benchmarks/first_chunk_timeline.py --models /tmp/m --repeats 3 --kernels $OUT/k-$name.txt --json $OUT/t-$name.json "$@" 2>&1 | grep -E "device ms per part|first chunks"
  echo "$name: $(( $(date +%s) - start )) s"
  find /tmp/ic-$name -name "*.best_config" | wc -l
  grep -h "ms of kernels" $OUT/k-$name.txt
}
one default True --batches 1 16 64
one nopw False --batches 1 16 64
one only1 True --batches 1
