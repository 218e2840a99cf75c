#!/usr/bin/env bash
# Stop the cluster tests/slurm/start_cluster.sh started: cancel its jobs, stop slurmd, slurmctld
# and munged, kill what is left of its jobs' processes, delete $SHARDLIB_SLURM_DIR. Idempotent:
# with nothing running it does nothing, and it never touches another Slurm on this machine (only
# the processes of its own pid files, and job processes whose SLURM_CONF is its slurm.conf).
set -uo pipefail

DIR=${SHARDLIB_SLURM_DIR:-/tmp/shardlib-slurm}
export SLURM_CONF=$DIR/slurm.conf
[ -d "$DIR" ] || exit 0

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop() {  # stop PIDFILE...: SIGTERM, up to 15 s to exit, then SIGKILL
  local pidfile pids=() deadline=$((SECONDS + 15))
  for pidfile in "$@"; do alive "$pidfile" && pids+=("$(cat "$pidfile")"); done
  [ ${#pids[@]} = 0 ] && return 0
  kill -TERM "${pids[@]}" 2>/dev/null
  while any_alive "${pids[@]}" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  kill -KILL "${pids[@]}" 2>/dev/null || true
}

any_alive() {
  local pid
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

job_processes() {  # pids of this cluster's job steps (slurmstepd's tasks and their children)
  local environ
  for environ in /proc/[0-9]*/environ; do
    grep -qzx "SLURM_CONF=$SLURM_CONF" "$environ" 2>/dev/null && grep -qz "^SLURM_JOB_ID=" "$environ" 2>/dev/null \
      && { environ=${environ#/proc/}; echo "${environ%/environ}"; }
  done
}

if alive "$DIR/slurmctld.pid"; then
  jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    # shellcheck disable=SC2086
    timeout 10 scancel $jobs 2>/dev/null
    deadline=$((SECONDS + 40))  # KillWait (30 s) lets a job's processes exit on SIGTERM
    while [ -n "$(timeout 10 squeue -h -o %A 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
  fi
fi
stop "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"
stop "$DIR/munged.pid"  # last: the others sign their goodbyes with it
for pid in $(job_processes); do kill -KILL "$pid" 2>/dev/null; done
for pid in $(pgrep -x slurmstepd); do  # a step daemon outlives its slurmd; ours work in $DIR
  case $(readlink "/proc/$pid/cwd") in "$DIR"/*) kill -KILL "$pid" 2>/dev/null ;; esac
done
rm -rf "$DIR"
exit 0
