#!/usr/bin/env bash
# Install and start a small Slurm cluster on this machine (root, no systemd, no cgroups), for the
# real-Slurm tests (tests/test_slurm_real.py). Idempotent: a second call returns at once when the
# cluster already answers.
#
# The cluster has NODES "nodes" (default 2: n1, n2), all on 127.0.0.1, one slurmd each (Debian's
# build supports several slurmd per host), so multi-node sbatch templates (colocated, and
# learner + rollout nodes) can be exercised on one machine. Two partitions:
#   debug   (default)                    jobs there are requeued when preempted (GraceTime 20 s)
#   urgent  (higher PriorityTier)        a job there preempts debug jobs
# Fast scheduler intervals and a short credential lifetime let a requeued job restart within
# seconds (the default cred_expire of 120 s delays every restart by two minutes).
# KillWait 30 s (SIGTERM to SIGKILL on a cancel): the stand-in ranks checkpoint at once, but on a loaded machine the
# batch script's own end (its log lines after the learner exits) came after 8 s and was killed. (A stand-in rank
# blocked on a failed peer gives up by itself 10 s after its SIGTERM, tests/slurm_standin.py, not at KillWait.)
#
#   .ci/slurm_up.sh          start (or check) the cluster
#   .ci/slurm_up.sh --stop   end the daemons this script started (by their pid files)
set -euo pipefail

NODES=${NODES:-2}
CPUS_PER_NODE=${CPUS_PER_NODE:-4}       # declared, not real: the scheduler only counts them
MEM_PER_NODE_MB=${MEM_PER_NODE_MB:-4000}
ROOT=/var/lib/megapo-slurm              # state, spool and logs of this cluster
CONF=/etc/slurm/slurm.conf

say() { echo "[slurm_up] $*"; }

if [ "${1:-}" = --stop ]; then
    for pidfile in /run/megapo-slurm/slurmd-*.pid /run/megapo-slurm/slurmctld.pid /run/munge/munged.pid; do
        [ -s "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        if kill "$pid" 2>/dev/null; then say "stopped $(basename "$pidfile" .pid) ($pid)"; fi
        rm -f "$pidfile"
    done
    exit 0
fi

nodes_idle() {  # true when every node reports idle (or is running jobs: mixed/allocated)
    local states
    states=$(timeout 10 sinfo -h -N -o '%T' 2>/dev/null) || return 1
    [ -n "$states" ] || return 1
    [ "$(echo "$states" | wc -l)" -ge "$NODES" ] || return 1
    ! echo "$states" | grep -vqE '^(idle|mixed|allocated|completing)$'
}

if command -v sinfo >/dev/null && pgrep -x slurmctld >/dev/null && nodes_idle; then
    say "already up: $(sinfo -h -o '%P %D %T' | tr '\n' ' ')"
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "slurm_up.sh must run as root (it installs packages and starts daemons)" >&2
    exit 1
fi

# ---------------------------------------------------------------- packages
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    say "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # policy-rc.d 101: the packages' postinst must not try to start services (no systemd here)
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# ---------------------------------------------------------------- munge
if ! pgrep -x munged >/dev/null; then
    [ -s /etc/munge/munge.key ] || { say "creating munge key"; mungekey --create --force 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    runuser -u munge -- munged
fi
for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.2; done
munge -n | unmunge >/dev/null || { echo "munged does not answer" >&2; exit 1; }

# ---------------------------------------------------------------- config
mkdir -p "$ROOT/state" "$ROOT/log" /run/megapo-slurm
NODE_LINES=""
for i in $(seq 1 "$NODES"); do
    mkdir -p "$ROOT/spool/n$i"
    NODE_LINES+="NodeName=n$i NodeAddr=127.0.0.1 NodeHostname=$(hostname) Port=$((17000 + i)) CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE_MB State=UNKNOWN"$'\n'
done
mkdir -p "$(dirname "$CONF")"
cat > "$CONF" <<EOF
# Written by megapo's .ci/slurm_up.sh: a test cluster on 127.0.0.1.
ClusterName=megapo
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=200
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
KillWait=30
MinJobAge=900
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
SlurmctldPidFile=/run/megapo-slurm/slurmctld.pid
SlurmdPidFile=/run/megapo-slurm/slurmd-%n.pid
JobCompType=jobcomp/filetxt
JobCompLoc=$ROOT/log/jobcomp.txt
${NODE_LINES}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=20
PartitionName=urgent Nodes=ALL Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF

# ---------------------------------------------------------------- daemons
if ! pgrep -x slurmctld >/dev/null; then
    say "starting slurmctld"
    setsid slurmctld -D -i >>"$ROOT/log/slurmctld.stdout" 2>&1 < /dev/null &
fi
for i in $(seq 1 "$NODES"); do
    if ! pgrep -f "slurmd -D -N n$i( |\$)" >/dev/null; then
        say "starting slurmd n$i"
        setsid slurmd -D -N "n$i" >>"$ROOT/log/slurmd-n$i.stdout" 2>&1 < /dev/null &
    fi
done

for _ in $(seq 120); do
    if nodes_idle; then
        say "up: $(sinfo -h -o '%P %D %T' | tr '\n' ' ')"
        exit 0
    fi
    sleep 0.5
done
echo "Slurm did not come up within 60 s; sinfo says:" >&2
sinfo -N >&2 || true
tail -n 20 "$ROOT/log/slurmctld.log" >&2 || true
exit 1
