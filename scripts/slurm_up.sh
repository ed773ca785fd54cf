#!/bin/bash
# Start a single-node SLURM (Debian/Ubuntu packages) for tests and CI. Run as root.
# Installs slurmctld, slurmd, munge and PMIx with apt when missing (~10-40 s on a fresh machine),
# writes /etc/slurm/slurm.conf for this host and starts the daemons. If SLURM is already up it
# changes nothing. The daemons it started are listed in $SLURM_DIR/started, for slurm_down.sh.
# Exit status: 0 up, 3 cannot install (not root, no apt-get), 1 other failure.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SLURM_DIR=${SLURM_DIR:-/tmp/slurm}
PACKAGES="slurmctld slurmd slurm-client munge libpmix2"

# 'scontrol ping' answers at once; sinfo retries for ~9 s while no controller runs.
slurm_is_up() {
  scontrol ping 2>/dev/null | grep -q "is UP" && sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)$'
}
if command -v scontrol >/dev/null && slurm_is_up; then echo "slurm already up"; exit 0; fi
[ "$(id -u)" = 0 ] || { echo "cannot start SLURM: not root" >&2; exit 3; }
if ! dpkg -s $PACKAGES >/dev/null 2>&1; then
  command -v apt-get >/dev/null || { echo "cannot install SLURM: no apt-get" >&2; exit 3; }
  timeout 300 apt-get update -qq
  timeout 600 apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null
fi
# Slurm's mpi_pmix plugin dlopens the unversioned libpmix.so (normally from libpmix-dev, which
# drags in autotools): without the link, --mpi=pmix is missing.
PMIXLIB=$(dirname "$(dpkg -L libpmix2 | grep "/pmix2/lib/libpmix.so.2$")")
[ -e "$PMIXLIB/libpmix.so" ] || ln -s libpmix.so.2 "$PMIXLIB/libpmix.so"
H=$(hostname -s); N=$(getconf _NPROCESSORS_ONLN)  # not nproc: it follows OMP_NUM_THREADS
mkdir -p /run/munge "$SLURM_DIR"/{state,spool,log}
: > "$SLURM_DIR/started"
chown munge:munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --force 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 2>/dev/null
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
fi
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=ci
SlurmctldHost=$H(127.0.0.1)
SlurmUser=root
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
MpiDefault=pmix
NodeName=$H NodeAddr=127.0.0.1 CPUs=$N State=UNKNOWN
PartitionName=debug Nodes=$H Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
# Silences the Open MPI wheel's PMIx complaining that it has no 'munge' security component.
echo 'PMIxEnv=PMIX_SECURITY_MODE=native' > /etc/slurm/mpi.conf
if ! { [ -s /run/munge/munged.pid ] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; }; then
  runuser -u munge -- /usr/sbin/munged
  echo /run/munge/munged.pid >> "$SLURM_DIR/started"
fi
timeout 20 slurmctld && echo "$SLURM_DIR/slurmctld.pid" >> "$SLURM_DIR/started"
timeout 20 slurmd && echo "$SLURM_DIR/slurmd.pid" >> "$SLURM_DIR/started"
for i in $(seq 60); do
  slurm_is_up && { echo "slurm up after ${i}x0.5s"; exit 0; }
  sleep 0.5
done
echo "slurm did not come up" >&2; tail -n 20 "$SLURM_DIR"/log/*.log >&2; exit 1
