#!/usr/bin/env bash
# The GPU checks of gradsync, in one run on a machine with a CUDA GPU (docs/gpu.md, "Checking a GPU
# machine"). Every check is compared with a reference and fails when it differs; --plan lists them.
#
#   scripts/gpu_check.sh                    # writes everything under ${OUT:-./gpu-out}
#   scripts/gpu_check.sh --plan             # the checks and their references; installs nothing
#   PYTHON=/opt/venv/bin/python OUT=/tmp/gpu scripts/gpu_check.sh
#
# Install step (within 3 minutes): a venv ($VENV, default ./.gpu-venv) over $PYTHON (default
# /opt/torch/.venv/bin/python3 where it exists, else python3) with --system-site-packages, and, when
# $PYTHON is itself a venv, its site-packages added through a .pth file: the preinstalled torch and
# cupy, and the NCCL they load, are used as they are. Only what is missing goes into the venv: from the
# wheelhouse ($WHEELHOUSE, default ./.whl, filled by scripts/gpu_wheelhouse.sh) with pip --no-index
# --no-deps when it holds wheels (a machine without a registry), else from the package index. The
# script never names an NCCL wheel, and fails if one landed in the venv. gradsync itself is used
# from this checkout (PYTHONPATH=src).
#
# Then (each step under a timeout, its output in $OUT/<step>.log, PASS/FAIL and figures in
# $OUT/summary.txt): env, pytest, dist-cuda, nccl-train, mpi-train, example, timeline, bench (see
# --plan). ONLY="pytest dist-cuda bench" runs those groups alone (env always runs): a rerun of the
# checks a change touched, inside a short lease.
# Exit status: 0 when every check passed, 1 when one failed, 2 when there is no GPU or a requirement
# could not be installed. The whole run stops starting steps after BUDGET_S (450) seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-./gpu-out}
VENV=${VENV:-$ROOT/.gpu-venv}
WHEELHOUSE=${WHEELHOUSE:-$ROOT/.whl}
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    [[ -x /opt/torch/.venv/bin/python3 ]] && PYTHON=/opt/torch/.venv/bin/python3
fi
# The references (override any of them in the environment).
ACC_TOLERANCE=${ACC_TOLERANCE:-0.02}        # GPU example's test accuracy vs the CPU run's
MAX_OVERHEAD_PCT=${MAX_OVERHEAD_PCT:-3}     # gradsync NCCL step vs single-GPU step (issue 12)
MAX_MPI_RATIO=${MAX_MPI_RATIO:-4}           # 2 ranks on one GPU through MPI staging vs single step
MIN_OVERLAP_PCT=${MIN_OVERLAP_PCT:-0}       # allreduce time overlapping backward must exceed it
FUSION_BYTES=${FUSION_BYTES:-67108864}      # fusion buffer ("buckets") of the benchmark, 64 MiB
EXAMPLE_EPOCHS=${EXAMPLE_EPOCHS:-5}
ONLY=${ONLY:-}                              # groups to run (default all): pytest dist-cuda train example timeline bench
BENCH_REPEATS=${BENCH_REPEATS:-3}           # interleaved launches per benchmark configuration

plan() {
    cat <<EOF
plan: each check, and the reference it is compared with
  install      a venv over $PYTHON (system site packages) at $VENV; installs what it lacks of mpi4py,
               mpich (mpiexec), cffi, pycparser, numpy, ml_dtypes, pytest, pytest-timeout, scikit-learn, tqdm
               reference: each imports, mpi4py loads an MPI library, no NCCL wheel in the venv
  gpu          torch.cuda.is_available()
               reference: True (else exit 2)
  pytest       tests/test_gpu.py tests/test_nccl.py tests/test_device.py
               reference: none fails, and the GPU tests ran (not all skipped)
  dist-cuda    tests/parallel/test_torch_distributed_cuda.py: torch.distributed on backend "gradsync"
               with CUDA tensors (every call, DDP, FSDP2), 1 rank through NCCL, 2 ranks through MPI staging
               reference: numpy values and one process on the whole batch; none fails, none skipped
  nccl-train   DistributedOptimizer through NCCL, 1 rank (tests/workers/gpu_train.py)
               reference: one process training alone on the same batches: the same weights
  mpi-train    the same, 2 ranks sharing the GPU through MPI staging
               reference: one process training alone: the same weights
  example      examples/train_digits.py --device cuda, $EXAMPLE_EPOCHS epochs
               reference: the same run on the CPU: test accuracies within $ACC_TOLERANCE
  timeline     20 traced training steps of benchmarks/train_step.py (NCCL, 1 rank)
               reference: allreduce time overlapping backward above $MIN_OVERLAP_PCT %
  bench-nccl   benchmarks/train_step.py mlp, batch 256: gradsync over NCCL, 1 rank, fusion $FUSION_BYTES bytes
               reference: the single GPU without gradsync: median step at most $MAX_OVERHEAD_PCT % slower
  bench-mpi    the same, 2 ranks sharing the GPU through MPI staging
               reference: median step at most $MAX_MPI_RATIO x the single GPU's
  bench rows   beside them, figures only: gradsync with every gradient alone (GRADSYNC_SMALL_GRADIENT_BYTES=0),
               torch DDP over NCCL, torch DDP over the gradsync backend (1 rank each)
               (benchmark figures: medians of $BENCH_REPEATS interleaved launches of each)
EOF
}

if [[ ${1:-} == --plan ]]; then
    plan
    exit 0
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
plan | tee -a "$SUMMARY"

# ---- install ---------------------------------------------------------------------------------------
INSTALL_LOG=$OUT/install.log
: > "$INSTALL_LOG"
INSTALL_DEADLINE=$((SECONDS + 180))
VPY=$VENV/bin/python

make_venv() {
    [[ -x $VPY ]] && "$VPY" -c "" 2>/dev/null && return
    "$PYTHON" -m venv --system-site-packages --without-pip "$VENV" >> "$INSTALL_LOG" 2>&1
    # A venv made from a venv sees the base interpreter's site-packages, not its parent's: add those.
    local parent
    parent=$("$PYTHON" -c 'import site, sys; print(site.getsitepackages()[0] if sys.prefix != sys.base_prefix else "")')
    if [[ -n $parent ]]; then
        echo "import site; site.addsitedir('$parent')" > "$("$VPY" -c 'import site; print(site.getsitepackages()[0])')/_gpu_check_parent.pth"
    fi
}

pip_install() {  # pip_install ARGS...: into the venv, with whichever pip there is
    local left=$((INSTALL_DEADLINE - SECONDS))
    (( left > 5 )) || { echo "install: out of time (3 minutes)" >> "$INSTALL_LOG"; return 1; }
    echo "+ pip install $*" >> "$INSTALL_LOG"
    if ! "$VPY" -m pip --version > /dev/null 2>&1; then
        "$VPY" -m ensurepip --default-pip >> "$INSTALL_LOG" 2>&1 || true
    fi
    if "$VPY" -m pip --version > /dev/null 2>&1; then
        timeout "$left" "$VPY" -m pip install --disable-pip-version-check "$@" >> "$INSTALL_LOG" 2>&1
    elif command -v uv > /dev/null; then
        timeout "$left" uv pip install --python "$VPY" "$@" >> "$INSTALL_LOG" 2>&1
    else
        echo "install: no pip in $VENV (no pip in $PYTHON's environment, no ensurepip, no uv)" >> "$INSTALL_LOG"
        return 1
    fi
}

have_wheelhouse() { compgen -G "$WHEELHOUSE/*.whl" > /dev/null; }

in_wheelhouse() {  # in_wheelhouse DIST: a wheel of it is in the wheelhouse (wheel names use _ for -)
    compgen -G "$WHEELHOUSE/${1//-/_}-*.whl" > /dev/null
}

install() {  # install DIST...: from the wheelhouse when it has wheels (offline), else from the index
    if have_wheelhouse; then
        pip_install --no-index --find-links "$WHEELHOUSE" --no-deps "$@"
    else
        pip_install "$@"
    fi
}

missing_distributions() {  # missing_distributions required|steps: what the venv lacks
    "$VPY" - "$1" <<'EOF'
import importlib.util, sys
# module -> the distributions that provide it, with the dependencies a --no-deps install must name
required = {"mpi4py": ["mpi4py"], "cffi": ["cffi", "pycparser"], "numpy": ["numpy"],
            "ml_dtypes": ["ml-dtypes"], "pytest": ["pytest"]}
steps = {"pytest_timeout": ["pytest-timeout"], "sklearn": ["scikit-learn"], "tqdm": ["tqdm"]}
need = required if sys.argv[1] == "required" else steps
print(" ".join(d for module, dists in need.items() if importlib.util.find_spec(module) is None for d in dists))
EOF
}

MPI_LABEL=""
mpi_works() {  # mpi4py in the venv loads an MPI library (it need not start MPI for that)
    MPI_LABEL=$(PYTHONPATH=$ROOT/src "$VPY" -c \
        'from gradsync.process import launch; print(launch.mpi_library(launch.import_mpi()).label)' 2>> "$INSTALL_LOG")
}

no_nccl_in_venv() {
    local site nccl
    site=$("$VPY" -c 'import site; print(site.getsitepackages()[0])')
    nccl=$(ls -d "$site"/nvidia_nccl* "$site"/nvidia/nccl 2>/dev/null || true)
    [[ -z $nccl ]] || { say "FAIL install: an NCCL wheel landed in the venv ($nccl): it must use torch's"; return 1; }
}

STEPS_LACK=""   # what the example step lacks where the wheelhouse does not have it
install_step() {
    make_venv || { say "FAIL install: could not create the venv $VENV from $PYTHON (see $INSTALL_LOG)"; return 1; }
    local required=() steps=() wanted=() source=index dist
    read -r -a required <<< "$(missing_distributions required)"
    read -r -a steps <<< "$(missing_distributions steps)"
    [[ -n ${MPIEXEC:-} || -x $VENV/bin/mpiexec ]] || required+=(mpich)
    wanted=("${required[@]}" "${steps[@]}")
    if have_wheelhouse; then
        source="wheelhouse $WHEELHOUSE (pip --no-index)"
        wanted=("${required[@]}")
        for dist in "${steps[@]}"; do
            if in_wheelhouse "$dist"; then wanted+=("$dist"); else STEPS_LACK+="$dist "; fi
        done
    fi
    if (( ${#wanted[@]} )); then
        say "install: missing ${wanted[*]}: installing from the $source"
        local python_packages=("${wanted[@]/mpich}")
        read -r -a python_packages <<< "${python_packages[*]}"
        if (( ${#python_packages[@]} )); then
            install "${python_packages[@]}" || { say "FAIL install: pip failed (see $INSTALL_LOG)"; return 1; }
        fi
        # mpich's library and mpiexec must land in the venv's lib/ and bin/, where mpi4py looks,
        # even where $PYTHON's environment has the wheel.
        if [[ " ${wanted[*]} " == *" mpich "* ]]; then
            install --ignore-installed mpich || { say "FAIL install: pip failed (see $INSTALL_LOG)"; return 1; }
        fi
    else
        say "install: nothing missing"
    fi
    [[ -z $STEPS_LACK ]] || say "NOTE: not in the wheelhouse, so the steps that need them fail: $STEPS_LACK"
    if ! mpi_works; then  # a preinstalled mpi4py built for another MPI: the venv gets its own
        say "install: the preinstalled mpi4py loads no MPI here: installing mpi4py from the $source"
        install --ignore-installed mpi4py || { say "FAIL install: pip failed (see $INSTALL_LOG)"; return 1; }
        mpi_works || { say "FAIL install: mpi4py loads no MPI library (see $INSTALL_LOG)"; return 1; }
    fi
    no_nccl_in_venv || return 1
    read -r -a required <<< "$(missing_distributions required)"
    if (( ${#required[@]} )); then
        say "FAIL install: still missing ${required[*]} (see $INSTALL_LOG)"
        return 1
    fi
    say "install: ready in $SECONDS s: $VPY, mpi4py loads $MPI_LABEL"
}
if ! install_step; then
    say "      the requirements could not be installed: fill the wheelhouse with scripts/gpu_wheelhouse.sh"
    exit 2
fi
MPIEXEC=${MPIEXEC:-$VENV/bin/mpiexec}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}   # one host: NCCL's bootstrap on the loopback
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# ---- GPU -------------------------------------------------------------------------------------------
if ! "$VPY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>"$OUT/gpu-probe.log"; then
    say "FAIL: no GPU: torch.cuda.is_available() is False for $VPY (or torch does not import; see $OUT/gpu-probe.log)."
    say "      This script needs a machine with a CUDA GPU; the CPU tests are: python -m pytest tests"
    exit 2
fi
MPI_FLAGS=()
if "$MPIEXEC" --version 2>&1 | grep -qE "Open MPI|OpenRTE|PRRTE"; then
    MPI_FLAGS=(--allow-run-as-root --oversubscribe)
fi
MPIRUN=("$MPIEXEC" "${MPI_FLAGS[@]}")

selected() {  # selected GROUP: whether ONLY (empty: everything) names it
    [[ -z $ONLY || " $ONLY " == *" $1 "* ]]
}
failed=0
DEADLINE=$((SECONDS + ${BUDGET_S:-450}))   # the whole run stays under 8 minutes
step() {  # step NAME TIMEOUT COMMAND...: run it, log it, record PASS/FAIL
    local name=$1 limit=$2; shift 2
    local started=$SECONDS left=$((DEADLINE - SECONDS))
    if (( left < 15 )); then
        say "FAIL $name: not run, the time budget (BUDGET_S=${BUDGET_S:-450} s) is spent"
        failed=1
        return 1
    fi
    (( limit > left )) && limit=$left
    if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
        say "PASS $name ($((SECONDS - started)) s)"
    else
        say "FAIL $name (exit $?, $((SECONDS - started)) s): see $OUT/$name.log"
        tail -n 15 "$OUT/$name.log" | sed 's/^/      /' | tee -a "$SUMMARY"
        failed=1
        return 1
    fi
}
judge() {  # judge NAME PYTHON-CODE: the comparison with the reference; the code prints its figures
    local name=$1 code=$2
    if "$VPY" -c "$code" > "$OUT/$name.judge" 2>&1; then
        say "PASS $name: $(tr '\n' ' ' < "$OUT/$name.judge")"
    else
        say "FAIL $name: $(tr '\n' ' ' < "$OUT/$name.judge")"
        failed=1
    fi
}

# ---- env -------------------------------------------------------------------------------------------
step env 60 bash -c "nvidia-smi; \"$VPY\" - <<'EOF'
import torch, mpi4py, gradsync
from gradsync.process import launch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0))
print('mpi4py', mpi4py.__version__, launch.mpi_library(launch.import_mpi()).label)
print('nccl_built', gradsync.nccl_built(), 'nccl_version', gradsync.nccl_version())
if gradsync.nccl_built():
    print('nccl_library', gradsync.backends.nccl_api.load_library().path, gradsync.backends.nccl_api.load_library().source)
try:
    import cupy
    print('cupy', cupy.__version__)
except Exception as exc:
    print('cupy: not available:', exc)
EOF" || true
grep -E "^(torch|mpi4py|nccl_|cupy)" "$OUT/env.log" | sed 's/^/      /' | tee -a "$SUMMARY" || true

# ---- tests -----------------------------------------------------------------------------------------
if selected pytest; then
step pytest 200 "$VPY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/pytest.xml" \
    tests/test_gpu.py tests/test_nccl.py tests/test_device.py || true
[[ -f $OUT/pytest.xml ]] && judge pytest-gpu-ran "
import xml.etree.ElementTree as ET
cases = ET.parse('$OUT/pytest.xml').getroot().iter('testcase')
gpu = [c for c in cases if c.get('classname', '').endswith('test_gpu')]
ran = [c for c in gpu if c.find('skipped') is None]
print(f'{len(ran)} of {len(gpu)} tests of tests/test_gpu.py ran (reference: more than 0)')
raise SystemExit(0 if ran else 1)"
fi

# torch.distributed on the gradsync backend with CUDA tensors: pytest on every rank (tests/parallel)
DIST_TEST=(-m pytest -q -rs -p no:cacheprovider tests/parallel/test_torch_distributed_cuda.py)
if selected dist-cuda; then
    step dist-cuda-nccl 120 "${MPIRUN[@]}" -n 1 "$VPY" "${DIST_TEST[@]}" || true
    step dist-cuda-mpi 150 env GRADSYNC_GPU_OPERATIONS=MPI "${MPIRUN[@]}" -n 2 "$VPY" "${DIST_TEST[@]}" || true
    judge dist-cuda "
import re
bad = False
for name in ('dist-cuda-nccl', 'dist-cuda-mpi'):
    lines = [l for l in open('$OUT/' + name + '.log').read().splitlines() if re.search(r'[0-9]+ (passed|failed)', l)]
    line = lines[-1].strip('= ') if lines else 'no pytest summary'
    counts = {what.rstrip('s'): int(n) for n, what in re.findall(r'([0-9]+) (passed|failed|skipped|errors?)', line)}
    print(f'{name}: {line};')
    bad = bad or not counts.get('passed') or bool(counts.get('failed') or counts.get('error'))
raise SystemExit(1 if bad else 0)"
fi

if selected train; then
step nccl-train 90 "${MPIRUN[@]}" -n 1 "$VPY" tests/workers/gpu_train.py || true
step mpi-train 90 env GRADSYNC_GPU_OPERATIONS=MPI "${MPIRUN[@]}" -n 2 "$VPY" tests/workers/gpu_train.py || true
fi

# ---- the example: GPU against CPU ------------------------------------------------------------------
EXAMPLE=(examples/train_digits.py --epochs "$EXAMPLE_EPOCHS" --no-progress)
if selected example && step example-cpu 120 "${MPIRUN[@]}" -n 1 "$VPY" "${EXAMPLE[@]}" --device cpu --checkpoint "$OUT/digits-cpu.pt" &&
   step example-cuda 120 "${MPIRUN[@]}" -n 1 "$VPY" "${EXAMPLE[@]}" --device cuda --checkpoint "$OUT/digits-cuda.pt"; then
    judge example "
def accuracy(name):
    return float(open('$OUT/' + name + '.log').read().split('test_accuracy=')[-1].split()[0])
cpu, gpu = accuracy('example-cpu'), accuracy('example-cuda')
print(f'test accuracy: cuda {gpu:.4f}, cpu {cpu:.4f} (reference: difference <= $ACC_TOLERANCE)')
raise SystemExit(0 if abs(gpu - cpu) <= $ACC_TOLERANCE else 1)"
fi

# ---- timeline and overlap --------------------------------------------------------------------------
BENCH=(benchmarks/train_step.py --device cuda --batch 256 --steps 100 --warmup 10)
if selected timeline && step timeline 90 env GRADSYNC_TIMELINE="$OUT/timeline.json" "${MPIRUN[@]}" -n 1 "$VPY" "${BENCH[@]}" \
        --mode gradsync --steps 20 --fusion-threshold "$FUSION_BYTES"; then
    judge overlap "
from gradsync.timeline import load, summarize
s = summarize(load('$OUT/timeline.json'))
pct = 100 * s['overlap_fraction']
print(f\"allreduce time overlapping backward: {s['overlapped_us'] / 1e3:.2f} ms of {s['allreduce_us'] / 1e3:.2f} ms \"
      f'({pct:.1f} %; reference: > $MIN_OVERLAP_PCT %)')
raise SystemExit(0 if pct > $MIN_OVERLAP_PCT else 1)"
fi

# ---- benchmark: interleaved launches, medians ------------------------------------------------------
if selected bench; then
for repeat in $(seq "$BENCH_REPEATS"); do
    step "bench-single-$repeat" 60 "$VPY" "${BENCH[@]}" --mode single || true
    step "bench-nccl-$repeat" 60 "${MPIRUN[@]}" -n 1 "$VPY" "${BENCH[@]}" --mode gradsync \
        --fusion-threshold "$FUSION_BYTES" || true
    step "bench-pergrad-$repeat" 60 env GRADSYNC_SMALL_GRADIENT_BYTES=0 "${MPIRUN[@]}" -n 1 "$VPY" \
        "${BENCH[@]}" --mode gradsync --fusion-threshold "$FUSION_BYTES" || true
    step "bench-ddpnccl-$repeat" 60 "${MPIRUN[@]}" -n 1 "$VPY" "${BENCH[@]}" --mode ddp --ddp-backend nccl || true
    step "bench-ddpgradsync-$repeat" 60 "${MPIRUN[@]}" -n 1 "$VPY" "${BENCH[@]}" --mode ddp \
        --ddp-backend gradsync || true
    step "bench-mpi-$repeat" 90 env GRADSYNC_GPU_OPERATIONS=MPI "${MPIRUN[@]}" -n 2 "$VPY" "${BENCH[@]}" \
        --mode gradsync --fusion-threshold "$FUSION_BYTES" || true
done
BENCH_FIGURES="
import glob, re, statistics
def median(kind):
    runs = [float(m.group(1)) for f in sorted(glob.glob('$OUT/bench-' + kind + '-*.log'))
            for m in [re.search(r'median_step_ms=([0-9.]+)', open(f).read())] if m]
    if not runs:
        raise SystemExit(f'no figure from bench-{kind} (see $OUT/bench-{kind}-*.log)')
    return statistics.median(runs), len(runs)
(single, n), (nccl, _), (mpi, _) = median('single'), median('nccl'), median('mpi')
print(f'median step (mlp, batch 256 per rank, medians of {n} launches x 100 steps): single {single:.2f} ms, '
      f'gradsync NCCL {nccl:.2f} ms ({100 * (nccl / single - 1):+.1f} %), MPI staging 2 ranks {mpi:.2f} ms '
      f'({mpi / single:.2f} x)')
for kind, label in (('pergrad', 'gradsync NCCL, every gradient alone'), ('ddpnccl', 'DDP over NCCL'),
                    ('ddpgradsync', 'DDP over the gradsync backend')):
    try:
        value, _ = median(kind)
        print(f'{label} {value:.2f} ms ({100 * (value / single - 1):+.1f} %)')
    except SystemExit as missing:
        print(missing)
"
judge bench-nccl "$BENCH_FIGURES
print('reference: NCCL <= single + $MAX_OVERHEAD_PCT %')
raise SystemExit(0 if nccl <= single * (1 + $MAX_OVERHEAD_PCT / 100) else 1)"
judge bench-mpi "$BENCH_FIGURES
print('reference: MPI staging <= $MAX_MPI_RATIO x single')
raise SystemExit(0 if mpi <= single * $MAX_MPI_RATIO else 1)"
fi

if (( failed )); then say "RESULT: FAIL"; exit 1; fi
say "RESULT: PASS"
