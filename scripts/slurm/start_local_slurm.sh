#!/usr/bin/env bash
# Start a real one-node Slurm on this machine (Debian's slurm-wlm: munged, slurmctld, slurmd), for
# tests/integration/test_slurm.py and for trying `hydra/launcher=submitit_slurm` by hand.
#
#   scripts/slurm/start_local_slurm.sh            # start it (idempotent: a running one is left alone)
#   scripts/slurm/start_local_slurm.sh --install  # apt-get install slurm-wlm munge first when missing
#
# Needs root (it writes /etc/slurm/slurm.conf and starts the daemons). One node named after this
# host, at 127.0.0.1, with 2 CPUs, in partition `local`; no cgroups (proctrack/linuxproc,
# task/none); no accounting (no slurmdbd: `sacct` is refused, `scontrol show job` works). The
# daemons are started directly (no systemd). Exit 0 when `sinfo` shows the node idle or allocated;
# otherwise one line `start_local_slurm: cannot start Slurm: <reason>` on stderr and exit 1.
# Do not run it under flock(1): the daemons would inherit the lock.
set -uo pipefail

CPUS=${TRAINLAB_SLURM_CPUS:-2}
PARTITION=local
CONF=/etc/slurm/slurm.conf
LOG_DIR=/var/log/slurm
die() { echo "start_local_slurm: cannot start Slurm: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (it writes $CONF and starts munged, slurmctld and slurmd); run it as root"

if [ "${1:-}" = "--install" ] && ! command -v slurmctld >/dev/null; then
    command -v apt-get >/dev/null || die "slurmctld is not installed and there is no apt-get to install slurm-wlm"
    echo "start_local_slurm: installing slurm-wlm munge with apt-get"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; } >/tmp/start_local_slurm.apt.log 2>&1 \
        || die "apt-get install slurm-wlm munge failed (see /tmp/start_local_slurm.apt.log: $(tail -1 /tmp/start_local_slurm.apt.log))"
fi
for bin in munged slurmctld slurmd sbatch sinfo scontrol; do
    command -v "$bin" >/dev/null || die "$bin is not installed (apt-get install slurm-wlm munge, or run this with --install)"
done

node=$(hostname -s)
if sinfo -h -n "$node" -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated|completing)'; then
    echo "start_local_slurm: Slurm is running (node $node: $(sinfo -h -n "$node" -o %T))"
    exit 0
fi

# munge: the key Debian's package made, else a new one
if ! pgrep -u munge -x munged >/dev/null; then
    [ -s /etc/munge/munge.key ] || { mungekey --create --force >/dev/null 2>&1 || die "cannot create /etc/munge/munge.key"; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1 || die "munged did not start (see /var/log/munge/munged.log)"
fi
munge -n 2>/dev/null | unmunge >/dev/null 2>&1 || die "munge does not work (munge -n | unmunge fails; see /var/log/munge/munged.log)"

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
cat >"$CONF.new" <<CONF
# Written by trainlab's scripts/slurm/start_local_slurm.sh: one node on this machine, no cgroups.
ClusterName=trainlab
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it starts again (default 120)
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SchedulerParameters=sched_interval=2
KillWait=30
NodeName=$node NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=$PARTITION Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
mv "$CONF.new" "$CONF"

# daemons left from an earlier start (the node is down or drained): make them read this config
pgrep -x slurmctld >/dev/null && { scontrol reconfigure >/dev/null 2>&1 || true; }
pgrep -x slurmctld >/dev/null || slurmctld </dev/null >/dev/null 2>&1 || die "slurmctld did not start (see $LOG_DIR/slurmctld.log: $(tail -1 $LOG_DIR/slurmctld.log 2>/dev/null))"
pgrep -x slurmd >/dev/null || slurmd </dev/null >/dev/null 2>&1 || die "slurmd did not start (see $LOG_DIR/slurmd.log: $(tail -1 $LOG_DIR/slurmd.log 2>/dev/null))"

for _ in $(seq 60); do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null)
    case "$state" in
        idle|mixed|allocated|completing) echo "start_local_slurm: Slurm is running (node $node: $state, $CPUS CPUs, partition $PARTITION)"; exit 0 ;;
        down*|drain*) scontrol update nodename="$node" state=resume >/dev/null 2>&1 ;;
    esac
    sleep 1
done
die "node $node is not up after 60 s (sinfo: ${state:-no answer}; see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log)"
