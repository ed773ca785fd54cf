#!/usr/bin/env bash
# Fill the wheelhouse that scripts/gpu_check.sh installs from on a GPU machine that reaches no package
# registry (the lent machine of docs/gpu.md: Python 3.12, x86-64, torch and cupy preinstalled). It holds
# exactly what that machine lacks, each wheel named and pinned, its dependencies too (downloaded with
# --no-deps, installed there with --no-deps): never torch, cupy or an NCCL wheel, which the machine has
# (a second NCCL wheel would overwrite torch's libnccl.so.2).
#
#   scripts/gpu_wheelhouse.sh                      # into ./.whl for CPython 3.12 on manylinux x86-64
#   WHEELHOUSE=DIR PY_VERSION=3.11 scripts/gpu_wheelhouse.sh
#   scripts/gpu_wheelhouse.sh --list               # what it would download, nothing else
#
# .whl/ is git-ignored: hand it to the GPU machine beside the checkout (the device tool's carry: [".whl"]).
# Stops with an error when the wheels exceed MAX_MIB (32) in all.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELHOUSE=${WHEELHOUSE:-./.whl}
PY_VERSION=${PY_VERSION:-3.12}
MAX_MIB=${MAX_MIB:-32}

WHEELS=(
    mpich==5.0.2      # the MPI library and its mpiexec (Hydra): the machine has no MPI runtime
    mpi4py==4.1.2     # installed only where the preinstalled mpi4py cannot load this MPICH
    cffi==2.1.1       # gradsync's NCCL binding loads libnccl.so.2 through cffi
    pycparser==3.12   # cffi's one dependency
)

if [[ ${1:-} == --list ]]; then
    printf '%s\n' "${WHEELS[@]}"
    exit 0
fi
mkdir -p "$WHEELHOUSE"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELHOUSE" "${WHEELS[@]}"
ls -l "$WHEELHOUSE"/*.whl
bytes=$(cat "$WHEELHOUSE"/*.whl | wc -c)
echo "wheelhouse $WHEELHOUSE: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $((bytes / 1048576)) MiB"
if (( bytes > MAX_MIB * 1048576 )); then
    echo "the wheelhouse exceeds MAX_MIB=$MAX_MIB MiB: remove stale wheels from $WHEELHOUSE" >&2
    exit 1
fi
