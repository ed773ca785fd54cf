#!/usr/bin/env bash
# The GPU checks of gradsync, in one run on a machine with a CUDA GPU (docs/gpu.md, "Checking a GPU
# machine"). Installs nothing: torch (CUDA build), mpi4py with an MPI, cffi, numpy, ml_dtypes and
# pytest must be importable by $PYTHON; cupy is optional; NCCL comes from the nvidia-nccl-cu12/cu13
# wheel (torch's CUDA wheels bring one), GRADSYNC_NCCL_LIBRARY or the system. gradsync itself is
# used from this checkout (PYTHONPATH=src).
#
#   scripts/gpu_check.sh                    # writes everything under ${OUT:-./gpu-out}
#   PYTHON=/opt/venv/bin/python OUT=/tmp/gpu scripts/gpu_check.sh
#
# Steps (each under a timeout, its output in $OUT/<step>.log):
#   env         versions of the GPU, driver, torch, cupy, NCCL, MPI
#   pytest      the gpu-marked tests (tests/test_gpu.py, tests/test_nccl.py) and the fake-GPU tests
#   nccl-train  DistributedOptimizer on the GPU through NCCL (world of 1) equals one process
#   mpi-train   2 ranks sharing the GPU through the MPI staging path equal one process
#   example-cuda  examples/train_digits.py --device cuda (one process per GPU via local_rank())
#   timeline    a timeline of 20 training steps (NCCL), and its ALLREDUCE/BACKWARD overlap figure
#   benchmark   step time: one process without gradsync, gradsync NCCL (1 rank), gradsync MPI (2 ranks)
# $OUT/summary.txt lists PASS/FAIL per step and the figures. Exit status: 0 when every step passed,
# 1 when one failed, 2 when there is no GPU or a requirement is missing. Takes about 3-5 minutes;
# every step has a timeout and the whole run stops starting steps after BUDGET_S (450) seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}   # one host: NCCL's bootstrap on the loopback
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

say() { echo "$*" | tee -a "$SUMMARY"; }

# ---- requirements ----------------------------------------------------------------------------------
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>"$OUT/gpu-probe.log"; then
    say "FAIL: no GPU: torch.cuda.is_available() is False for $PYTHON (or torch does not import; see $OUT/gpu-probe.log)."
    say "      This script needs a machine with a CUDA GPU; the CPU tests are: python -m pytest tests"
    exit 2
fi
missing=()
for module in mpi4py cffi numpy ml_dtypes pytest; do
    "$PYTHON" -c "import $module" 2>/dev/null || missing+=("$module")
done
MPIEXEC=${MPIEXEC:-$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")/mpiexec}
[[ -x "$MPIEXEC" ]] || MPIEXEC=$(command -v mpiexec || true)
[[ -n "$MPIEXEC" ]] || missing+=("mpiexec (pip install mpich, or a system MPI matching mpi4py)")
if (( ${#missing[@]} )); then
    say "FAIL: missing requirements: ${missing[*]} (install them offline, e.g. from a wheelhouse: pip install --no-index --find-links DIR mpi4py mpich)"
    exit 2
fi
MPI_FLAGS=()
if "$MPIEXEC" --version 2>&1 | grep -qE "Open MPI|OpenRTE|PRRTE"; then
    MPI_FLAGS=(--allow-run-as-root --oversubscribe)
fi
MPIRUN=("$MPIEXEC" "${MPI_FLAGS[@]}")

failed=0
DEADLINE=$((SECONDS + ${BUDGET_S:-450}))   # the whole run stays under 8 minutes
step() {  # step NAME TIMEOUT COMMAND...: run it, log it, record PASS/FAIL
    local name=$1 limit=$2; shift 2
    local started=$SECONDS left=$((DEADLINE - SECONDS))
    if (( left < 15 )); then
        say "FAIL $name: not run, the time budget (BUDGET_S=${BUDGET_S:-450} s) is spent"
        failed=1
        return
    fi
    (( limit > left )) && limit=$left
    if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
        say "PASS $name ($((SECONDS - started)) s)"
    else
        say "FAIL $name (exit $?, $((SECONDS - started)) s): see $OUT/$name.log"
        tail -n 15 "$OUT/$name.log" | sed 's/^/      /' | tee -a "$SUMMARY"
        failed=1
    fi
}

# ---- env -------------------------------------------------------------------------------------------
step env 60 bash -c "nvidia-smi; \"$PYTHON\" - <<'EOF'
import torch, mpi4py, gradsync
from mpi4py import MPI
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0))
print('mpi4py', mpi4py.__version__, MPI.Get_library_version().splitlines()[0])
print('nccl_built', gradsync.nccl_built(), 'nccl_version', gradsync.nccl_version())
try:
    import cupy
    print('cupy', cupy.__version__)
except Exception as exc:
    print('cupy: not available:', exc)
EOF"
grep -E "^(torch|mpi4py|nccl_built|cupy)" "$OUT/env.log" | sed 's/^/      /' | tee -a "$SUMMARY" || true
if ! "$PYTHON" -c 'import gradsync, sys; sys.exit(0 if gradsync.nccl_built() else 1)'; then
    say "NOTE: NCCL does not load ($PYTHON -c 'from gradsync import nccl; nccl.load_library()' says why):"
    say "      the NCCL steps will fail; install nvidia-nccl-cu13 (CUDA 13) or set GRADSYNC_NCCL_LIBRARY"
fi

# ---- tests -----------------------------------------------------------------------------------------
step pytest 200 "$PYTHON" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/pytest.xml" \
    tests/test_gpu.py tests/test_nccl.py tests/test_device.py
grep -E "passed|failed|skipped" "$OUT/pytest.log" | tail -n 1 | sed 's/^/      /' | tee -a "$SUMMARY" || true

step nccl-train 90 "${MPIRUN[@]}" -n 1 "$PYTHON" tests/workers/gpu_train.py
step mpi-train 90 env GRADSYNC_GPU_OPERATIONS=MPI "${MPIRUN[@]}" -n 2 "$PYTHON" tests/workers/gpu_train.py
# The README's example on the GPU (needs scikit-learn and tqdm; the step fails without them).
step example-cuda 120 "${MPIRUN[@]}" -n 1 "$PYTHON" examples/train_digits.py --device cuda --epochs 5 \
    --checkpoint "$OUT/digits.pt"

# ---- timeline and overlap --------------------------------------------------------------------------
BENCH=(benchmarks/train_step.py --device cuda --batch 256 --steps 30 --warmup 5)
step timeline 90 env GRADSYNC_TIMELINE="$OUT/timeline.json" "${MPIRUN[@]}" -n 1 "$PYTHON" "${BENCH[@]}" \
    --mode gradsync --steps 20
step timeline-summary 30 "$PYTHON" -m gradsync.timeline "$OUT/timeline.json"
grep -E "overlapping backward|ALLREDUCE|BACKWARD" "$OUT/timeline-summary.log" | sed 's/^/      /' | tee -a "$SUMMARY" || true

# ---- benchmark -------------------------------------------------------------------------------------
step bench-single 60 "$PYTHON" "${BENCH[@]}" --mode single
step bench-nccl 60 "${MPIRUN[@]}" -n 1 "$PYTHON" "${BENCH[@]}" --mode gradsync
step bench-mpi-2ranks 60 env GRADSYNC_GPU_OPERATIONS=MPI "${MPIRUN[@]}" -n 2 "$PYTHON" "${BENCH[@]}" \
    --mode gradsync
say "step time (mlp, batch 256 per rank, median of 30 steps; one H200):"
for name in bench-single bench-nccl bench-mpi-2ranks; do
    say "      $name: $(grep -h median_step_ms "$OUT/$name.log" 2>/dev/null || echo 'no figure')"
done

if (( failed )); then say "RESULT: FAIL"; exit 1; fi
say "RESULT: PASS"
