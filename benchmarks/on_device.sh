#!/usr/bin/env bash
# Runs a benchmark command on a GPU machine that has CUDA torch but not the service's other packages.
#
#   bash benchmarks/on_device.sh python3 -m realtime bench --models /tmp/m ...
#
# - Wheels for Python 3.12 / x86-64 in .whl/ and .whl-profile/ (made with benchmarks/wheels.sh; carry
#   .whl-profile only to profile) are installed into
#   /tmp/site, which goes on PYTHONPATH.
# - The full-size synthetic models are built into $MODELS (default /tmp/m) unless they exist.
# - Then the arguments run as a command, with unbuffered Python output and the repository on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    # .whl-profile/ (py-spy) where the call carried it.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl $(compgen -G ".whl-profile/*.whl" || true)
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/site/bin:$PATH  # the wheels' commands (py-spy)
fi
# The repository itself too: benchmarks/*.py scripts import `realtime` and `engines` from it.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
MODELS=${MODELS:-/tmp/m}
if [ ! -f "$MODELS/realtime-manifest.json" ]; then
    started=$(date +%s)
    python3 scripts/build_engines.py random --size full --out "$MODELS" >/dev/null
    echo "built full synthetic models in $MODELS in $(( $(date +%s) - started )) s"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
exec "$@"
