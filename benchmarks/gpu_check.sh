#!/usr/bin/env bash
# The GPU path's checks in one command that ends in <= 8 minutes (one device command may run 10):
# benchmarks/gpu_preflight.py first (<= 30 s; stops here if it fails), the kernels' CPU-side
# checks, the GPU tests (pytest -m gpu tests/gpu) and benchmarks/gpu_transfer.py. The summary
# table is always printed last (an EXIT trap), also when a step times out or the script is stopped.
#
#   benchmarks/gpu_check.sh                  on the GPU machine (no network needed)
#   benchmarks/gpu_check.sh --fetch-wheels   beforehand, where pip reaches an index: puts the
#                                            wheels of kvtierd's pure dependencies and of pytest in
#                                            .whl/ (for CPython 3.11-3.13; git-ignored, so a
#                                            copy to the GPU machine must carry it); exits with
#                                            pip's status
#
# Verdicts: exit 0 only if the GPU tests ran (none skipped) and passed, the CPU-side checks passed
# and the benchmark ran with its load hits asserted; exit 3 with "no GPU: nothing verified" where
# no GPU is usable; 1 otherwise. Installs nothing it need not: kvtierd and kvtier_client run from
# this checkout (PYTHONPATH); only the modules that fail to import are installed, from the carried
# wheels that fit this Python, into /tmp/kvt-site. CuPy and torch must already be there.
# Full logs and JSON go to $OUT (or a temp dir). GPU_CHECK_BUDGET_S (default 470) is the budget.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
# module=distribution==version: what the checks import, and the wheel that provides it
DEPS="zmq=pyzmq==27.3.0 msgpack=msgpack==1.2.4 xxhash=xxhash==3.6.0
prometheus_client=prometheus-client==0.23.1 pytest=pytest==9.2.0 pytest_timeout=pytest-timeout==2.4.0
pluggy=pluggy==1.7.0 iniconfig=iniconfig==2.3.1 packaging=packaging==26.4 pygments=pygments==2.21.0"

if [ "${1:-}" = "--fetch-wheels" ]; then
  status=0
  for version in ${WHEEL_PYTHONS:-3.11 3.12 3.13}; do
    # shellcheck disable=SC2046 # one argument per distribution
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      $(for dep in $DEPS; do echo "${dep#*=}"; done)
    rc=$?
    [ $rc -ne 0 ] && { echo "pip download for CPython $version failed ($rc)" >&2; status=$rc; }
  done
  ls -l .whl 2>/dev/null
  exit $status
fi

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"
STARTED=$(date +%s)
ROWS=()       # "step|verdict|seconds|detail"
VERDICT=""    # set by the step that decides; empty: not finished
EXIT_CODE=1
STEP_S=0

row() { ROWS+=("$1|$2|$3|${4//|//}"); }  # "|" separates the fields
left() { echo $(( BUDGET_S - ($(date +%s) - STARTED) )); }

summary() {
  local code=$EXIT_CODE
  [ -n "$VERDICT" ] || VERDICT="FAIL: stopped before the end (budget ${BUDGET_S} s or a signal)"
  echo
  echo "== gpu_check summary ($(( $(date +%s) - STARTED )) s of ${BUDGET_S} s; logs in $OUT) =="
  printf '%-36s %-8s %5s  %s\n' "step" "result" "s" "detail"
  local r step verdict secs detail
  for r in "${ROWS[@]}"; do
    IFS='|' read -r step verdict secs detail <<<"$r"
    printf '%-36s %-8s %5s  %s\n' "$step" "$verdict" "$secs" "$detail"
  done
  grep -qs '^preflight check' "$OUT/preflight.txt" && { echo; sed -n '/^preflight check/,$p' "$OUT/preflight.txt"; }
  grep -qs '^GPU transfer' "$OUT/bench.log" && { echo; sed -n '/^GPU transfer/,$p' "$OUT/bench.log"; }
  echo
  echo "gpu_check: $VERDICT"
  exit "$code"
}
trap summary EXIT
trap 'VERDICT="FAIL: stopped by a signal"; EXIT_CODE=124; exit 124' TERM INT

# step NAME SECONDS CMD...: run CMD with a timeout that also fits what is left of the budget
step() {
  local name=$1 want=$2; shift 2
  local have; have=$(( $(left) - 15 ))  # 15 s kept for the summary
  [ "$want" -gt "$have" ] && want=$have
  if [ "$want" -le 5 ]; then
    STEP_S=0
    echo "$name: no budget left" >&2
    return 124
  fi
  local t0 rc; t0=$(date +%s)
  timeout -k 5 "$want" "$@"
  rc=$?
  STEP_S=$(( $(date +%s) - t0 ))
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "$name: timed out after $want s" >&2
  return $rc
}

# -- is there a GPU at all? ------------------------------------------------------------------
gpu_reason=$("$PY" - <<'EOF' 2>&1
try:
    import cupy
except Exception as exc:
    print(f"CuPy cannot be imported ({exc})")
    raise SystemExit
if getattr(cupy, "STANDIN", False):
    print("CuPy is the CPU stand-in of tests/helpers, not a GPU")
    raise SystemExit
try:
    n = cupy.cuda.runtime.getDeviceCount()
    print("" if n > 0 else "CuPy sees no CUDA device")
except Exception as exc:
    print(f"CuPy cannot use CUDA ({exc})")
EOF
)
if [ -n "$gpu_reason" ]; then
  row "GPU" "none" 0 "$gpu_reason"
  VERDICT="no GPU: nothing verified ($gpu_reason)"
  EXIT_CODE=3
  exit 3
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
row "GPU" "yes" 0 "$(tail -n +2 "$OUT/gpu.txt" | head -1)"

# -- dependencies: install only what is missing, from wheels that fit this Python ------------
missing=()
for dep in $DEPS; do
  module=${dep%%=*}
  "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$module') is None)" \
    || missing+=("${dep#*=}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "missing: ${missing[*]}; installing them from .whl/"
  if ! "$PY" -m pip install -q --no-index --find-links .whl --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/kvt-site "${missing[@]}" > "$OUT/pip.log" 2>&1; then
    row "dependencies" "FAIL" 0 "pip could not install ${missing[*]} from .whl/ (see pip.log; run '$0 --fetch-wheels' where pip works and carry .whl)"
    VERDICT="FAIL: dependencies missing"
    exit 1
  fi
  export PYTHONPATH="/tmp/kvt-site${PYTHONPATH:+:$PYTHONPATH}"
  row "dependencies" "ok" 0 "installed ${missing[*]}"
else
  row "dependencies" "ok" 0 "all present"
fi
mkdir -p /tmp/kvt-path && ln -sfn "$ROOT/client" /tmp/kvt-path/kvtier_client
export PYTHONPATH="$ROOT:/tmp/kvt-path${PYTHONPATH:+:$PYTHONPATH}"
export KVTIER_CUDA_DIR="$ROOT/cuda"
"$PY" -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)" \
  > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

# -- preflight: what only a GPU can tell; stop here if it fails ------------------------------
step "preflight (gpu_preflight.py)" 45 "$PY" benchmarks/gpu_preflight.py --json "$OUT/preflight.json" \
  > "$OUT/preflight.txt" 2>&1
rc=$?
cat "$OUT/preflight.txt"
if [ $rc -ne 0 ]; then
  row "preflight (gpu_preflight.py)" "FAIL" "$STEP_S" "exit $rc: stopped before the tests"
  VERDICT="FAIL: preflight failed, nothing else was run (table above)"
  exit 1
fi
row "preflight (gpu_preflight.py)" "ok" "$STEP_S" ""

# -- tests -----------------------------------------------------------------------------------
# warnings are not errors here: this image's package versions are not the project's pins
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider -o "filterwarnings=default" --timeout 150)
failed=()

step "CPU-side kernel checks" 90 "${PYTEST[@]}" tests/unit/cuda tests/unit/client/test_kernels.py \
  tests/unit/kvtierd/test_staging_cuda.py tests/unit/kvtierd/tiers/test_pinning.py \
  > "$OUT/unit.log" 2>&1
rc=$?
row "CPU-side kernel checks" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "$STEP_S" "$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/unit.log" | tail -1)"
[ $rc -eq 0 ] || failed+=("CPU-side checks")

step "GPU tests (-m gpu tests/gpu)" 240 "${PYTEST[@]}" -m gpu --junitxml="$OUT/gpu_tests.xml" tests/gpu \
  > "$OUT/gpu_tests.log" 2>&1
rc=$?
counts=$("$PY" - "$OUT/gpu_tests.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0 0"); raise SystemExit
suites = [root] if root.tag == "testsuite" else list(root)
n = sum(int(s.get("tests", 0)) for s in suites)
bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(n - skipped - bad, bad, skipped)
EOF
)
read -r ran bad skipped <<<"$counts"
skip_why=$(grep -E '^SKIPPED' "$OUT/gpu_tests.log" | sed -E 's/^SKIPPED \[[0-9]+\] [^ ]+: //' | sort -u | head -3 | paste -sd ';' -)
if [ $rc -eq 0 ] && [ "${ran:-0}" -gt 0 ] && [ "${skipped:-0}" -eq 0 ]; then
  row "GPU tests (-m gpu tests/gpu)" "ok" "$STEP_S" "$ran passed"
else
  detail="exit $rc: ${ran:-0} passed, ${bad:-0} failed, ${skipped:-0} skipped"
  [ -n "$skip_why" ] && detail="$detail; skipped because: $skip_why"
  row "GPU tests (-m gpu tests/gpu)" "FAIL" "$STEP_S" "$detail"
  failed+=("GPU tests")
fi

step "benchmark (gpu_transfer.py)" 200 "$PY" benchmarks/gpu_transfer.py --json "$OUT/gpu_transfer.json" \
  > "$OUT/bench.log" 2>&1
rc=$?
row "benchmark (gpu_transfer.py)" "$([ $rc -eq 0 ] && echo ran || echo FAIL)" "$STEP_S" "$([ $rc -eq 0 ] || tail -1 "$OUT/bench.log")"
[ $rc -eq 0 ] || failed+=("benchmark")

if [ ${#failed[@]} -eq 0 ]; then
  VERDICT="PASS (GPU tests ran and passed; ratios in the table above)"
  EXIT_CODE=0
else
  VERDICT="FAIL: ${failed[*]}"
  EXIT_CODE=1
fi
exit "$EXIT_CODE"
