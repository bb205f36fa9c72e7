#!/usr/bin/env bash
# The GPU validation kit on the device machine (docs/gpu.md): install the carried wheels into /tmp/site,
# run tools/gpu_check.py under a hard timeout, leave gpu_check.json, gpu_check.txt and the log in $OUT.
#
#   bash tools/gpu_check.sh                     # on the H200, from the repository root, `.whl` carried
#   OUT=/tmp/x GPU_CHECK_WHEELS= PYTHON=.venv/bin/python bash tools/gpu_check.sh --cpu-dry-run   # here, no wheels
#
# Environment: OUT (default ./gpu_check_out), PYTHON (default python3), GPU_CHECK_WHEELS (folder of wheels,
# default .whl; empty: install none), GPU_CHECK_BUDGET_S (the check's own budget, default 450).
# Other arguments go to tools/gpu_check.py (e.g. --cpu-dry-run, --sections logprobs,train_step).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu_check_out}
WHEELS=${GPU_CHECK_WHEELS-.whl}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
mkdir -p "$OUT" || exit 2

if [ -n "$WHEELS" ]; then
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "gpu_check.sh: no wheels in '$WHEELS' (carry .whl, see docs/gpu.md; GPU_CHECK_WHEELS= installs none)" >&2
        exit 2
    fi
    # the device README's install line: no index, no dependencies, into a folder of its own
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${wheels[@]}" >"$OUT/pip.log" 2>&1; then
        echo "gpu_check.sh: pip install failed:" >&2
        tail -20 "$OUT/pip.log" >&2
        exit 3
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# the check ends itself within its budget; the hard limit is for a wedged interpreter
timeout -k 15 $((BUDGET + 60)) "$PYTHON" -m tools.gpu_check --out "$OUT" --budget-s "$BUDGET" "$@" 2>&1 \
    | tee "$OUT/gpu_check.log"
exit $?
