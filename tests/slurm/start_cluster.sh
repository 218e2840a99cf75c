#!/usr/bin/env bash
# A real Slurm cluster on this machine: munged, slurmctld and two slurmd (nodes node1, node2) on
# localhost, for tests/test_slurm.py. Idempotent: a cluster already up is left as it is.
#
#   tests/slurm/start_cluster.sh            install the packages if missing, start, wait for idle nodes
#   tests/slurm/start_cluster.sh --install  only install the packages (Debian's slurmctld, slurmd,
#                                           slurm-client, munge; needs root and apt-get)
#   tests/slurm/stop_cluster.sh             stop every daemon and job, delete the state
#
# Everything lives in $SHARDLIB_SLURM_DIR (default /tmp/shardlib-slurm): slurm.conf, munge's key
# and socket, state, spool, logs. Nothing is written to /etc; commands find the cluster through
#   export SLURM_CONF=$SHARDLIB_SLURM_DIR/slurm.conf
# Two slurmd on one host need a Slurm built with --enable-multiple-slurmd, which Debian's is: each
# node gets its own port and is started with `slurmd -N nodeN`.
# In a container: no systemd (daemons are started directly), no cgroups (proctrack/linuxproc
# follows a step's processes through /proc, task/none binds nothing), no slurmdbd and database
# (job accounting: jobacct_gather/linux for live steps, jobcomp/filetxt for finished jobs, read
# with `sacct --completion`).
#
# Exit status: 0 the cluster is up; 3 the packages are missing and cannot be installed here
# (the tests skip); anything else a failure, with the daemons' logs on stderr.
set -euo pipefail

DIR=${SHARDLIB_SLURM_DIR:-/tmp/shardlib-slurm}
CTLD_PORT=${SHARDLIB_SLURM_PORT:-16817}  # slurmctld; the nodes listen on the next two ports
NODES=(node1 node2)
CPUS_PER_NODE=2
export SLURM_CONF=$DIR/slurm.conf
PACKAGES=(slurmctld slurmd slurm-client munge)
COMMANDS=(slurmctld slurmd sbatch srun scontrol sinfo squeue sacct scancel munged mungekey)

say() { echo "start_cluster: $*" >&2; }

missing_commands() {
  local missing=()
  for c in "${COMMANDS[@]}"; do command -v "$c" >/dev/null || missing+=("$c"); done
  echo "${missing[@]}"
}

install_packages() {
  [ -z "$(missing_commands)" ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    say "missing $(missing_commands); installing Slurm needs root and apt-get (Debian/Ubuntu): apt-get install ${PACKAGES[*]}"
    exit 3
  fi
  say "installing ${PACKAGES[*]} from the system's packages"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           "${PACKAGES[@]}" >/dev/null; }; then
    say "apt-get could not install ${PACKAGES[*]}"
    exit 3
  fi
  [ -z "$(missing_commands)" ] || { say "still missing after the install: $(missing_commands)"; exit 3; }
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

nodes_idle() {  # every node answers and is idle
  local states
  states=$(timeout 10 sinfo -h -N -o "%N %t" 2>/dev/null) || return 1
  [ "$(grep -c ' idle$' <<<"$states")" = "${#NODES[@]}" ]
}

running() {
  alive "$DIR/munged.pid" && alive "$DIR/slurmctld.pid" || return 1
  for node in "${NODES[@]}"; do alive "$DIR/slurmd-$node.pid" || return 1; done
}

fail() {
  say "$*"
  for log in "$DIR"/log/*.log; do [ -f "$log" ] && { echo "--- ${log#"$DIR"/}" >&2; tail -n 15 "$log" >&2; }; done
  exit 1
}

write_config() {
  local host
  host=$(hostname -s)
  cat >"$SLURM_CONF" <<EOF
# Written by tests/slurm/start_cluster.sh: two nodes on this host (${NODES[*]}), state in $DIR.
ClusterName=shardlib
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again cred_expire + 1 s later (default 121 s)
AuthInfo=socket=$DIR/munge.socket,cred_expire=20
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# no cgroups in a container: processes are tracked through /proc; no CPU binding (the nodes share cores)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# no database: live steps are measured (sstat), finished jobs are logged to a file (sacct -c)
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
# first come, first served; pending jobs looked at every 2 s (default 60 s)
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# the nodes share this machine's cores; each counts CPUS_PER_NODE of them, even on a smaller machine
SlurmdParameters=config_overrides
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$(IFS=,; echo "${NODES[*]}") NodeHostname=$host NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 1))-$((CTLD_PORT + ${#NODES[@]})) CPUs=$CPUS_PER_NODE State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  mkdir -p -m 700 "$DIR/munge"
  [ -f "$DIR/munge/munge.key" ] || mungekey --create --keyfile="$DIR/munge/munge.key"
  munged --socket="$DIR/munge.socket" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" || fail "munged did not start"
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...: poll until COMMAND succeeds
  local limit=$1 what=$2 deadline=$((SECONDS + $1))
  shift 2
  until "$@"; do
    [ $SECONDS -lt $deadline ] || fail "$what: not after ${limit}s"
    sleep 0.5
  done
}

install_packages
[ "${1:-}" = --install ] && exit 0
if [ "$(id -u)" != 0 ]; then
  say "slurmd starts each job's processes as its user, so it runs as root: run this as root"
  exit 3
fi

if running && nodes_idle; then
  say "already up ($SLURM_CONF)"
  exit 0
fi
"$(dirname "$0")/stop_cluster.sh" >/dev/null 2>&1 || true  # a half-started or stale cluster
mkdir -p -m 755 "$DIR"
mkdir -p "$DIR/state" "$DIR/log" "${NODES[@]/#/$DIR/spool/}"
write_config
start_munge
slurmctld || fail "slurmctld did not start"
for node in "${NODES[@]}"; do slurmd -N "$node" || fail "slurmd for $node did not start"; done
wait_for 90 "nodes ${NODES[*]} idle in sinfo" nodes_idle
say "up: $(sinfo -h -N -o '%N %t' | tr '\n' ' ')(SLURM_CONF=$SLURM_CONF, $(sinfo -V))"
