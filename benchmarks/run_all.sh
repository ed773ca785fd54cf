#!/usr/bin/env bash
# Run every benchmark, then regenerate docs/benchmarks.md's tables and docs/img/*.png.
#
#   benchmarks/run_all.sh                 # the full set (about 10 minutes on 2 quiet cores)
#   QUICK=1 RESULTS=/tmp/r DOCS=/tmp/b.md IMAGES=/tmp/img benchmarks/run_all.sh   # smoke test
#
# Settings (environment variables): PYTHON (default: python3 on PATH; its mpiexec is used),
# RESULTS (CSV folder, default benchmarks/results), DOCS (default docs/benchmarks.md),
# IMAGES (default docs/img), SWEEP_RANKS (default "2 4"), RANKS (negotiation, idle impact and
# training; default 2), REPEATS (launches per configuration; default 3), QUICK=1 (tiny sizes).
# Everything else in the environment (MALLOC_*, GRADSYNC_*) reaches the benchmarks unchanged and is
# recorded in each CSV file and printed under each table.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
MPIEXEC="$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")/mpiexec"
RESULTS=${RESULTS:-benchmarks/results}
DOCS=${DOCS:-docs/benchmarks.md}
IMAGES=${IMAGES:-docs/img}
SWEEP_RANKS=${SWEEP_RANKS:-2 4}
RANKS=${RANKS:-2}
REPEATS=${REPEATS:-3}

if [[ "${QUICK:-0}" == 1 ]]; then
    SWEEP=(--max-bytes 1M --factor 4 --budget 0.1 --min-iters 3 --warmup 1)
    IDLE=(--rounds 2 --iters 5)
    NEGOTIATION=(--tensors 10,100 --budget 0.2 --rounds 20)
    TRAIN=(--steps 3 --thresholds 1048576)
    REPEATS=1
else
    SWEEP=()
    IDLE=()
    NEGOTIATION=()
    TRAIN=()
fi

mkdir -p "$RESULTS"
echo "== $("$PYTHON" -c 'import sys; sys.path.insert(0, "benchmarks"); import benchenv
print(benchenv.mpi_library())'), $(nproc) cores, MALLOC_MMAP_MAX_=${MALLOC_MMAP_MAX_:-unset}" \
     "MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-unset}"
for n in $SWEEP_RANKS; do
    echo "== collectives.py, $n ranks"
    "$MPIEXEC" -n "$n" "$PYTHON" benchmarks/collectives.py "${SWEEP[@]}" --csv "$RESULTS/collectives-$n.csv"
done
echo "== collectives.py --idle-impact, $RANKS ranks"
"$MPIEXEC" -n "$RANKS" "$PYTHON" benchmarks/collectives.py --idle-impact "${IDLE[@]}" \
    --csv "$RESULTS/idle-impact-$RANKS.csv"
echo "== negotiation.py --compare, $RANKS ranks"
"$PYTHON" benchmarks/negotiation.py --compare --ranks "$RANKS" --repeats "$REPEATS" "${NEGOTIATION[@]}" \
    --csv "$RESULTS/negotiation-$RANKS.csv"
for model in mlp cnn transformer; do
    echo "== train_step.py --compare --model $model, $RANKS ranks"
    "$PYTHON" benchmarks/train_step.py --compare --model "$model" --ranks "$RANKS" --repeats "$REPEATS" \
        "${TRAIN[@]}" --csv "$RESULTS/train-$model-$RANKS.csv"
done
echo "== plots and tables"
"$PYTHON" benchmarks/plot.py --results "$RESULTS" --out "$IMAGES"
"$PYTHON" benchmarks/report.py --results "$RESULTS" --images "$IMAGES" --docs "$DOCS"
