#!/usr/bin/env bash
# Start-up of this tree against another on one machine (the lent machines' host speed differs by a third,
# so restarts compare only within one): a cold start of this tree, then a restart of the BASE tree and one
# of this tree, both on the compile cache the cold start left. Through on_device.sh's set-up:
#
#   git archive REV engines realtime benchmarks scripts pyproject.toml | tar -x -C .gpu/base   # here
#   BASE=.gpu/base bash benchmarks/on_device.sh bash benchmarks/startup_ab.sh                 # on the GPU
#
# Code the two trees compile differently (a changed DiT block) is compiled by the base's restart itself,
# which then is partly a cold start: say so when reporting. Reports land in $OUT (or bench-results/):
# head-cold.json, base-restart.json, head-restart.json and each start's server log.
#
# COLD=1 compares cold starts instead: each tree cold, then restarted on what its cold start left
# (base-cold.json, base-restart.json, head-cold.json, head-restart.json); each cold start clears the
# models' compile cache first. RESTART=0 leaves the restarts out (to fit one device call).
#
# HEAD_ENV="VAR=value ..." sets variables for this tree's starts only: with BASE=. an A/B of a setting,
# e.g. Inductor's C++ wrapper (docs/benchmarks.md, nineteenth session):
#
#   COLD=1 BASE=. HEAD_ENV="TORCHINDUCTOR_CPP_WRAPPER=1" bash benchmarks/on_device.sh bash benchmarks/startup_ab.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:?BASE names the other tree (see above)}
MODELS=${MODELS:-/tmp/m}
DEST=$(realpath -m "${OUT:-bench-results}")
mkdir -p "$DEST"
SERVE=(--device cuda --max-streams "${MAX_STREAMS:-320}")
SITE=/tmp/site  # on_device.sh's wheels
read -ra HEAD_VARS <<<"${HEAD_ENV:-}"

start() {  # TREE NAME [startup.py flags...]
    local tree=$1 name=$2
    shift 2
    local -a vars=()
    if [ "${name#head}" != "$name" ]; then vars=("${HEAD_VARS[@]}"); fi
    (cd "$tree" && env "${vars[@]}" PYTHONPATH="$PWD:$SITE" python3 benchmarks/startup.py --models "$MODELS" \
        --starts 1 "$@" --json "$DEST/$name.json" -- "${SERVE[@]}" 2>&1 | grep "^start" | sed "s/^/$name: /")
}

if [ "${COLD:-0}" = 1 ]; then
    start "$BASE" base-cold
    if [ "${RESTART:-1}" = 1 ]; then start "$BASE" base-restart --keep-cache; fi
    start . head-cold
    if [ "${RESTART:-1}" = 1 ]; then start . head-restart --keep-cache; fi
else
    start . head-cold
    start "$BASE" base-restart --keep-cache
    start . head-restart --keep-cache
fi
