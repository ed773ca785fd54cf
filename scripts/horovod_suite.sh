#!/bin/bash
# Horovod's own PyTorch tests (test/parallel/test_torch.py of horovod/horovod) against gradsync.torch,
# or with SUITE=tensorflow its TensorFlow tests (test/parallel/test_tensorflow.py) against
# gradsync.tensorflow, or with SUITE=tensorflow_keras / tensorflow2_keras its Keras tests
# (test/parallel/test_tensorflow[2]_keras.py) against gradsync.keras (KERAS_BACKEND=tensorflow),
# one test (or BATCH tests) per `mpiexec -n N python -m pytest` job under a timeout, as the workspace's
# shared/tools/hvd_suite.sh runs them, with two differences: each rank writes its pytest output to
# its own file, so the ranks' lines cannot interleave (the shared runner reads both from one stream
# and counted some passed tests as failed when "1 passed" did not start a line), and every test's
# outcome is listed with its skip reason or first error line.
#
# Needs gradsync.torch (gradsync.tensorflow) importable by `python` on PATH, mpiexec on PATH, and
# the horovod/horovod repository: a work tree or the bare git dir the search tool's `fetch github:horovod/horovod` gives.
# Usage: HVD_REPO=/path/to/horovod scripts/horovod_suite.sh [pytest -k expression]
# Environment: SUITE (torch, tensorflow, tensorflow_keras or tensorflow2_keras, default torch), RANKS
# (default 2), BATCH tests per mpiexec job (default 1; BATCH=20 runs test_tensorflow.py's 145 tests
# in about 25 minutes instead of an hour on a 2-core machine, each test's outcome still read from
# every rank's reports; a job that stalls loses no other test's outcome), TEST_TIMEOUT seconds a job
# may go without a test ending before it is stopped as stalled (default 90), OUT (default
# ${TMPDIR:-/tmp}/horovod-suite): where the shim, the outputs and results.txt go.
set -u
HVD_REPO=${HVD_REPO:-}
[ -n "$HVD_REPO" ] && [ -e "$HVD_REPO" ] || { echo "set HVD_REPO to a horovod/horovod repository"; exit 2; }
SUITE=${SUITE:-torch}; RANKS=${RANKS:-2}; BATCH=${BATCH:-1}; TEST_TIMEOUT=${TEST_TIMEOUT:-90}
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
# Each rank writes pytest's output to its own file, and a small plugin appends every report of a
# test as it happens (setup, call, each subtest -- TensorFlow's run_all_in_graph_and_eager_modes runs
# the graph-mode half as a subtest whose failure leaves the test's own line PASSED --, teardown) to
# LOG.outcomes.<rank>: a job that stalls keeps the outcomes of the tests before the stall.
cat > conftest.py <<'PY'
import os


def pytest_runtest_logreport(report):
    if "SUITE_LOG" not in os.environ:
        return
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    why = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        why = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
    elif report.skipped and isinstance(report.longrepr, tuple):
        why = report.longrepr[2]
    mode = getattr(report, "context", None)
    mode = f"[{mode.msg}] " if mode is not None and getattr(mode, "msg", None) else ""
    why = (mode + why).replace("\n", " ").replace("\t", " ")[:300]
    with open(f"{os.environ['SUITE_LOG']}.outcomes.{rank}", "a") as out:
        out.write(f"{report.nodeid.split('::')[-1]}\t{report.when}\t{report.outcome}\t{why}\n")
PY
run_rank='SUITE_LOG=$0 exec python -m pytest -v -rfE --color=no -p no:cacheprovider "$@" > "$0.${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}" 2>&1'
passed=0; failed=0; skipped=0; : > "$OUT/results.txt"; batch_no=0

# outcome TEST LOG: "passed", "skipped" or "failed<TAB>why" from LOG's outcome files: failed if any
# report of the test failed on any rank, skipped if every rank skipped it; nothing if some rank did not
# reach the test's teardown.
outcome() {
  local r reports all=""
  for ((r = 0; r < RANKS; r++)); do
    reports=$(grep -P "^$1\t" "$2.outcomes.$r" 2>/dev/null)
    grep -qP "\tteardown\t" <<< "$reports" || { echo ""; return; }
    all+="$reports"$'\n'
  done
  if grep -qP "\tfailed\t" <<< "$all"; then
    printf 'failed\t%s\n' "$(grep -P "\tfailed\t" <<< "$all" | head -1 | cut -f4 | cut -c1-200)"
  elif grep -qP "\tskipped\t" <<< "$all"; then
    printf 'skipped\t%s\n' "$(grep -P "\tskipped\t" <<< "$all" | head -1 | cut -f4)"
  else echo passed; fi
}

record() {  # record TEST OUTCOME WHY
  case $2 in passed) passed=$((passed + 1)) ;; skipped) skipped=$((skipped + 1)) ;; *) failed=$((failed + 1)) ;; esac
  echo "${2/stalled/failed} $1 $3" >> "$OUT/results.txt"
}

# run_watched LOG TEST...: the job, ended (rc 124) once no rank has finished a test for TEST_TIMEOUT s.
run_watched() {
  local log=$1 pid done=-1 now last=$SECONDS; shift
  mpiexec -n "$RANKS" sh -c "$run_rank" "$log" "$@" > "$log.launcher" 2>&1 & pid=$!
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    now=$(cat "$log".outcomes.* 2>/dev/null | grep -c teardown)
    if [ "$now" != "$done" ]; then done=$now; last=$SECONDS
    elif [ $((SECONDS - last)) -ge "$TEST_TIMEOUT" ]; then
      kill $pid 2>/dev/null; sleep 3; kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null; return 124
    fi
  done
  wait $pid
}

# run_batch TEST...: one `mpiexec -n RANKS` job for the tests; each test's outcome is read from every
# rank's output. If the job times out (a stall), the first test without an outcome is recorded as
# failed and the tests after it run again in a new job, so one stall loses no other test's result.
run_batch() {
  local log rc t short rest=()
  while [ $# -gt 0 ]; do
    batch_no=$((batch_no + 1)); log="$OUT/runs/batch$batch_no"
    printf '%s\n' "$@" > "$log.tests"
    run_watched "$log" "$@"; rc=$?
    rest=(); local stalled="" result
    for t in "$@"; do
      short=${t##*::}
      if [ -n "$stalled" ]; then rest+=("$t"); continue; fi
      result=$(outcome "$short" "$log")
      if [ -z "$result" ]; then
        record "$short" stalled "no outcome: the job went ${TEST_TIMEOUT}s without a test ending (rc=$rc)"; stalled=1
      else record "$short" "${result%%$'\t'*}" "$(cut -s -f2- <<< "$result")"; fi
    done
    set -- "${rest[@]}"
  done
}

batch=()
for t in $tests; do
  batch+=("$t")
  if [ ${#batch[@]} -ge "$BATCH" ]; then run_batch "${batch[@]}"; batch=(); fi
done
[ ${#batch[@]} -gt 0 ] && run_batch "${batch[@]}"
grep -v '^passed' "$OUT/results.txt"
echo "horovod test_$SUITE.py against gradsync, $RANKS ranks: passed $passed, failed $failed, skipped $skipped (every outcome: $OUT/results.txt)"
