#!/usr/bin/env bash
# The GPU path's checks in one command (< 8 minutes on one H200): the kernels' CPU-side checks, the
# GPU tests (pytest -m gpu tests/gpu) and benchmarks/gpu_transfer.py; a short table last.
#
#   benchmarks/gpu_check.sh                  on the GPU machine (no network needed)
#   benchmarks/gpu_check.sh --fetch-wheels   beforehand, where pip reaches an index: puts the
#                                            wheels of kvtierd's pure dependencies in .whl/
#                                            (git-ignored through .git/info/exclude)
#
# Installs nothing it need not: kvtierd and kvtier_client run from this checkout (PYTHONPATH), and
# the wheels in .whl/ are installed into /tmp/kvt-site only when an import fails. CuPy and torch
# must already be there (the GPU image has both). Full logs and JSON go to $OUT (or a temp dir).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DEPS="pyzmq==27.3.0 msgpack==1.2.4 xxhash==3.6.0 prometheus-client==0.23.1"

if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $DEPS
  ls -l .whl
  exit $?
fi

OUT="${OUT:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1
started=$(date +%s)

missing=$("$PY" - <<'EOF'
import importlib.util as u
print(" ".join(m for m in ("zmq", "msgpack", "xxhash", "prometheus_client") if u.find_spec(m) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "missing: $missing; installing the carried wheels from .whl/"
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/*.whl: run '$0 --fetch-wheels' where pip works and carry .whl"; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvt-site .whl/*.whl || exit 2
  export PYTHONPATH="/tmp/kvt-site${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p /tmp/kvt-path && ln -sfn "$ROOT/client" /tmp/kvt-path/kvtier_client
export PYTHONPATH="$ROOT:/tmp/kvt-path${PYTHONPATH:+:$PYTHONPATH}"
export KVTIER_CUDA_DIR="$ROOT/cuda"

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
"$PY" -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"

# warnings are not errors here: this image's package versions are not the project's pins
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider -o "filterwarnings=default" --timeout 240)
timeout 200 "${PYTEST[@]}" tests/unit/cuda tests/unit/client/test_kernels.py \
  tests/unit/kvtierd/test_staging_cuda.py tests/unit/kvtierd/tiers/test_pinning.py 2>&1 | tee "$OUT/unit.log"
unit=${PIPESTATUS[0]}
timeout 300 "${PYTEST[@]}" -m gpu tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
gpu=${PIPESTATUS[0]}
timeout 200 "$PY" benchmarks/gpu_transfer.py --json "$OUT/gpu_transfer.json" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}

echo
echo "== gpu_check summary ($(( $(date +%s) - started )) s; logs in $OUT) =="
printf '%-34s %s\n' "CPU-side kernel checks" "$( [ $unit -eq 0 ] && echo pass || echo "FAIL ($unit)")" \
  "GPU tests (-m gpu tests/gpu)" "$( [ $gpu -eq 0 ] && echo pass || echo "FAIL ($gpu)")" \
  "benchmark" "$( [ $bench -eq 0 ] && echo ran || echo "FAIL ($bench)")"
grep -E "passed|failed|skipped" "$OUT/gpu_tests.log" | tail -1
sed -n '/^GPU transfer/,$p' "$OUT/bench.log"
[ $unit -eq 0 ] && [ $gpu -eq 0 ] && [ $bench -eq 0 ]
