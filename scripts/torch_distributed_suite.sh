#!/bin/bash
# PyTorch's own torch.distributed peer suite (DistributedTest._DistTestBase of the installed torch's
# torch/testing/_internal/distributed/distributed_test.py, which upstream runs for gloo, nccl and
# mpi) on gradsync's torch.distributed backend: BACKEND=gradsync, INIT_METHOD=gradsync://, each MPI
# rank of `mpiexec -n RANKS` playing the test process of its rank (scripts/torch_distributed_suite.py,
# beside this script, replaces MultiProcessTestCase's spawning by the ranks of one job).
#
# BATCH tests per mpiexec job (startup with torch's imports is about 3 s); a job that goes
# TEST_TIMEOUT seconds without a test ending on some rank is stopped, the test it was in is recorded
# as timed out, and the batch's remaining tests run again in a new job; a job that ends early (a rank
# crashed) records the test as failed and goes on the same way. So one hang or crash loses no other
# test's outcome.
#
# Needs gradsync.torch importable by `python` on PATH and mpiexec on PATH (the .venv's MPICH).
# Usage: scripts/torch_distributed_suite.sh [-k-style expression on test names, e.g. "all_reduce and not cuda"]
# Environment: PEER (gloo or mpi: the suite's gates by backend name are read as for that backend, so
# the tests it runs for gloo's or mpi's CPU features run too, on gradsync; default: none, the suite
# as it treats a new plugin backend), RANKS (default 2), BATCH tests per job (default 20; 1: one job per test), TEST_TIMEOUT
# seconds a job may go without a test ending (default 120), OUT (default
# ${TMPDIR:-/tmp}/torch-distributed-suite): the per-rank outputs and results.tsv (name, outcome,
# seconds, first line of the error or the skip reason; a failure on any rank fails the test).
set -u
RANKS=${RANKS:-2}; BATCH=${BATCH:-20}; TEST_TIMEOUT=${TEST_TIMEOUT:-120}
OUT=${OUT:-${TMPDIR:-/tmp}/torch-distributed-suite}
DRIVER="$(cd "$(dirname "$0")" && pwd)/torch_distributed_suite.py"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1 WORLD_SIZE=$RANKS BACKEND=gradsync INIT_METHOD=gradsync://
python -c "import expecttest" 2>/dev/null || python -m pip install -q expecttest >/dev/null 2>&1  # torch's common_utils needs it
rm -rf "$OUT"; mkdir -p "$OUT/runs"
tests=$(python "$DRIVER" list ${1:+-k "$1"}) || { echo "could not list the suite's tests"; exit 2; }
[ -n "$tests" ] || { echo "no test matches ${1:-}"; exit 2; }
run_rank='log=$1; shift; exec python "$0" run "$log" "$@" > "$log.${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}" 2>&1'
passed=0; failed=0; skipped=0; timed_out=0; batch_no=0
printf 'name\toutcome\tseconds\twhy\n' > "$OUT/results.tsv"

# outcome TEST LOG: "OUTCOME<TAB>SECONDS<TAB>WHY" from every rank's outcome file (failed if it failed
# on any rank, skipped if skipped on any, else passed), or nothing if some rank has no outcome.
outcome() {
  local r line all=""
  for ((r = 0; r < RANKS; r++)); do
    line=$(grep -P "^$1\t" "$2.outcomes.$r" 2>/dev/null) || { echo ""; return; }
    all+="$line"$'\n'
  done
  for kind in failed skipped passed; do
    line=$(grep -P "^[^\t]*\t$kind\t" <<< "$all" | head -1)
    [ -n "$line" ] && { cut -f2- <<< "$line"; return; }
  done
}

record() {  # record TEST OUTCOME SECONDS WHY
  case $2 in passed) passed=$((passed + 1)) ;; skipped) skipped=$((skipped + 1)) ;;
    timed_out) timed_out=$((timed_out + 1)) ;; *) failed=$((failed + 1)) ;; esac
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT/results.tsv"
}

# run_watched LOG TEST...: the job, in a process group of its own, stopped (rc 124) once no rank
# has finished a test for TEST_TIMEOUT s.
run_watched() {
  local log=$1 pid done=-1 now last=$SECONDS; shift
  mkdir -p "$log.tmp/barrier" "$log.tmp/test_dir"
  TEMP_DIR="$log.tmp" setsid mpiexec -n "$RANKS" sh -c "$run_rank" "$DRIVER" "$log" "$@" \
    > "$log.launcher" 2>&1 & pid=$!
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    now=$(cat "$log".outcomes.* 2>/dev/null | wc -l)
    if [ "$now" != "$done" ]; then done=$now; last=$SECONDS
    elif [ $((SECONDS - last)) -ge "$TEST_TIMEOUT" ]; then
      kill -TERM -- -$pid 2>/dev/null; sleep 3; kill -KILL -- -$pid 2>/dev/null; wait $pid 2>/dev/null
      return 124
    fi
  done
  wait $pid
}

run_batch() {  # run_batch TEST...: see the header
  local log rc t result stopped rest
  while [ $# -gt 0 ]; do
    batch_no=$((batch_no + 1)); log="$OUT/runs/batch$batch_no"
    printf '%s\n' "$@" > "$log.tests"
    run_watched "$log" "$@"; rc=$?
    rest=(); stopped=""
    for t in "$@"; do
      if [ -n "$stopped" ]; then rest+=("$t"); continue; fi
      result=$(outcome "$t" "$log")
      if [ -n "$result" ]; then record "$t" "${result%%$'\t'*}" "$(cut -f2 <<< "$result")" "$(cut -f3 <<< "$result")"
      elif [ "$rc" = 124 ]; then record "$t" timed_out "$TEST_TIMEOUT" "no test ended for ${TEST_TIMEOUT}s (outputs: $log.*)"; stopped=1
      else record "$t" failed "" "the job ended (rc=$rc) before this test ended on every rank (outputs: $log.*)"; stopped=1
      fi
    done
    rm -rf "$log.tmp"
    set -- "${rest[@]}"
  done
}

mapfile -t tests <<< "$tests"
for ((i = 0; i < ${#tests[@]}; i += BATCH)); do run_batch "${tests[@]:i:BATCH}"; done
grep -vP '\t(passed|skipped)\t' "$OUT/results.tsv" | tail -n +2
echo "torch's distributed_test.py on gradsync${PEER:+ (gated as $PEER)}, $RANKS ranks: passed $passed, failed $failed, skipped $skipped, timed out $timed_out (every outcome: $OUT/results.tsv)"
