#!/bin/bash
# Horovod's own PyTorch tests (test/parallel/test_torch.py of horovod/horovod) against gradsync.torch,
# or with SUITE=tensorflow its TensorFlow tests (test/parallel/test_tensorflow.py) against
# gradsync.tensorflow, or with SUITE=tensorflow_keras / tensorflow2_keras its Keras tests
# (test/parallel/test_tensorflow[2]_keras.py) against gradsync.keras (KERAS_BACKEND=tensorflow),
# one test per `mpiexec -n N python -m pytest` job under a timeout, as the workspace's
# shared/tools/hvd_suite.sh runs them, with two differences: each rank writes its pytest output to
# its own file, so the ranks' lines cannot interleave (the shared runner reads both from one stream
# and counted some passed tests as failed when "1 passed" did not start a line), and every test's
# outcome is listed with its skip reason or first error line.
#
# Needs gradsync.torch (gradsync.tensorflow) importable by `python` on PATH, mpiexec on PATH, and
# the horovod/horovod repository: a work tree or the bare git dir the search tool's `fetch github:horovod/horovod` gives.
# Usage: HVD_REPO=/path/to/horovod scripts/horovod_suite.sh [pytest -k expression]
# Environment: SUITE (torch, tensorflow, tensorflow_keras or tensorflow2_keras, default torch), RANKS (default 2), TEST_TIMEOUT seconds
# per test (default 90), OUT (default ${TMPDIR:-/tmp}/horovod-suite): where the shim, the outputs and results.txt go.
set -u
HVD_REPO=${HVD_REPO:-}
[ -n "$HVD_REPO" ] && [ -e "$HVD_REPO" ] || { echo "set HVD_REPO to a horovod/horovod repository"; exit 2; }
SUITE=${SUITE:-torch}; RANKS=${RANKS:-2}; TEST_TIMEOUT=${TEST_TIMEOUT:-90}
PKG=${SUITE%%_keras}; PKG=${PKG%2}  # the aliased package: torch or tensorflow
OUT=${OUT:-${TMPDIR:-/tmp}/horovod-suite}
show() { if [ -e "$HVD_REPO/$1" ]; then cat "$HVD_REPO/$1"; else git --git-dir="$HVD_REPO" show "HEAD:$1"; fi; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1
rm -rf "$OUT"; mkdir -p "$OUT/shim/horovod/$PKG" "$OUT/shim/horovod/runner/util" "$OUT/parallel" \
  "$OUT/utils" "$OUT/runs"
show "test/parallel/test_$SUITE.py" > "$OUT/parallel/test_$SUITE.py"
[ "$SUITE" = tensorflow ] && show test/parallel/base_test_tensorflow.py > "$OUT/parallel/base_test_tensorflow.py"
show test/utils/common.py > "$OUT/utils/common.py"
: > "$OUT/shim/horovod/__init__.py"; : > "$OUT/shim/horovod/runner/__init__.py"
: > "$OUT/shim/horovod/runner/util/__init__.py"
printf 'import sys\n\nimport gradsync.%s\n\nsys.modules[__name__] = gradsync.%s\n' "$PKG" "$PKG" \
  > "$OUT/shim/horovod/$PKG/__init__.py"  # `import horovod.torch as hvd` is gradsync.torch itself, etc.
if [ "$PKG" != "$SUITE" ]; then  # the Keras suites: horovod.tensorflow.keras and horovod.keras are gradsync.keras
  export KERAS_BACKEND=tensorflow
  mkdir -p "$OUT/shim/horovod/keras" "$OUT/shim/horovod/common"
  printf 'import gradsync.keras\n\ngradsync.tensorflow.keras = gradsync.keras\nsys.modules[__name__ + ".keras"] = gradsync.keras\n' \
    >> "$OUT/shim/horovod/tensorflow/__init__.py"
  printf 'import sys\n\nimport gradsync.keras\n\nsys.modules[__name__] = gradsync.keras\n' > "$OUT/shim/horovod/keras/__init__.py"
  : > "$OUT/shim/horovod/common/__init__.py"
  printf 'from packaging import version\n\n\ndef is_version_greater_equal_than(ver, target):\n    return version.parse(ver) >= version.parse(target)\n' \
    > "$OUT/shim/horovod/common/util.py"
fi
cat > "$OUT/shim/horovod/runner/util/threads.py" <<'PY'
import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
PY
python -m pip install -q mock cloudpickle packaging parameterized >/dev/null 2>&1
export PYTHONPATH="$OUT/shim:${PYTHONPATH:-}"
cd "$OUT/parallel" || exit 2
export TF_CPP_MIN_LOG_LEVEL=3
tests=$(python -m pytest --collect-only -q "test_$SUITE.py" ${1:+-k "$1"} 2>/dev/null | grep '::')
# One rank's output per file: the rank as MPICH (PMI_RANK) or Open MPI (OMPI_COMM_WORLD_RANK) sets it.
run_rank='exec python -m pytest -q -rsE --color=no -p no:cacheprovider "$0" > "$1.${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}" 2>&1'
passed=0; failed=0; skipped=0; : > "$OUT/results.txt"
for t in $tests; do
  short=${t##*::}; log="$OUT/runs/$short"
  timeout "$TEST_TIMEOUT" mpiexec -n "$RANKS" sh -c "$run_rank" "$t" "$log" > "$log.launcher" 2>&1; rc=$?
  outcome=passed
  for ((r = 0; r < RANKS; r++)); do
    last=$(grep -E '^[0-9]+ (passed|skipped|failed)|^=+ .*(passed|skipped|failed)' "$log.$r" 2>/dev/null | tail -1)
    case "$last" in *failed*|"") outcome=failed; break ;; *skipped*) outcome=skipped ;; esac
  done
  case $outcome in
    passed) passed=$((passed + 1)); why="" ;;
    skipped) skipped=$((skipped + 1)); why=$(grep -m1 -E '^SKIPPED' "$log.0" | sed 's/^SKIPPED \[[0-9]*\] //') ;;
    failed) failed=$((failed + 1))
      why="rc=$rc $(cat "$log".[0-9]* 2>/dev/null | grep -m1 -E '^E ' | cut -c1-200)" ;;
  esac
  echo "$outcome $short ${why}" >> "$OUT/results.txt"
done
grep -v '^passed' "$OUT/results.txt"
echo "horovod test_$SUITE.py against gradsync, $RANKS ranks: passed $passed, failed $failed, skipped $skipped (every outcome: $OUT/results.txt)"
