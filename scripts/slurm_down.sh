#!/bin/bash
# Stop the daemons that slurm_up.sh started (listed in $SLURM_DIR/started), by PID, and wait for
# them to exit. Daemons it found already running are left alone.
SLURM_DIR=${SLURM_DIR:-/tmp/slurm}
pids=""
[ -s "$SLURM_DIR/started" ] || exit 0
while read -r f; do
  [ -s "$f" ] && pids="$pids $(cat "$f")"
done < "$SLURM_DIR/started"
[ -n "$pids" ] && kill $pids 2>/dev/null
for i in $(seq 50); do
  alive=""; for p in $pids; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
  [ -z "$alive" ] && { rm -f "$SLURM_DIR/started"; exit 0; }
  sleep 0.2
done
echo "still alive after 10s:$alive" >&2; exit 1
