#!/usr/bin/env bash
# stop-slurm.sh - stop the daemons started by tests/slurm/start-slurm.sh, and only those.
#
# Reads "name pid starttime" lines from $SLURM_PIDFILE; a PID is signalled only
# if /proc/PID/comm still equals the recorded name AND its start time matches
# (protects against PID reuse). Never uses pkill/killall.
#
# Before stopping slurmd, all jobs of this (private, single-node) cluster are
# cancelled and we wait for them to leave the node, so no slurmstepd/job
# processes are left behind.  Set SLURM_STOP_KEEP_JOBS=1 to skip that.
set -uo pipefail
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:${PATH:-}"
export SLURM_CONF=/etc/slurm/slurm.conf

PROOF_DIR=${SMARTCKPT_SLURM_DIR:-/var/tmp/smartckpt-slurm}
PIDFILE=${SLURM_PIDFILE:-$PROOF_DIR/slurm.pids}
KEEP_JOBS=${SLURM_STOP_KEEP_JOBS:-0}

say() { echo "[stop-slurm] $*"; }

if [ ! -f "$PIDFILE" ]; then
  say "no pid file $PIDFILE: nothing to stop"
  exit 0
fi

starttime_of() { awk '{print $22}' "/proc/$1/stat" 2>/dev/null; }
is_same() {  # NAME PID STARTTIME
  [ -d "/proc/$2" ] && [ "$(cat "/proc/$2/comm" 2>/dev/null)" = "$1" ] \
    && [ "$(starttime_of "$2")" = "$3" ]
}

declare -A PID ST
while read -r n p st; do
  [ -n "${n:-}" ] || continue
  PID[$n]=$p; ST[$n]=$st
done < "$PIDFILE"

alive() { [ -n "${PID[$1]:-}" ] && is_same "$1" "${PID[$1]}" "${ST[$1]}"; }

# 1. cancel jobs while slurmctld + slurmd are still up
if [ "$KEEP_JOBS" != 1 ] && alive slurmctld; then
  jobs=$(timeout 10 squeue -h -o '%i' 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    say "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    timeout 10 scancel $jobs 2>/dev/null || true
    for _ in $(seq 1 100); do   # up to ~50 s (KillWait defaults to 30 s)
      left=$(timeout 10 squeue -h -t RUNNING,COMPLETING,CONFIGURING,SUSPENDED -o '%i' 2>/dev/null | wc -l)
      [ "$left" -eq 0 ] && break
      sleep 0.5
    done
    [ "${left:-0}" -eq 0 ] || say "WARNING: $left job(s) still running/completing"
  fi
fi

# 2. stop daemons in dependency order, TERM then KILL after 20 s
rc=0
for n in slurmd slurmctld munged; do
  [ -n "${PID[$n]:-}" ] || continue
  p=${PID[$n]}
  if ! alive "$n"; then
    say "$n (pid $p) not running (or pid reused): skipping"
    continue
  fi
  say "stopping $n (pid $p)"
  t0=$(date +%s%N)
  kill -TERM "$p" 2>/dev/null
  for _ in $(seq 1 200); do alive "$n" || break; sleep 0.1; done
  if alive "$n"; then
    say "$n (pid $p) ignored SIGTERM for 20 s: SIGKILL"
    kill -KILL "$p" 2>/dev/null
    sleep 0.5
  fi
  if alive "$n"; then say "ERROR: $n (pid $p) still alive"; rc=1; else say "$n stopped ($(( ($(date +%s%N) - t0) / 1000000 )) ms)"; fi
done

# slurmctld (running as user slurm) cannot remove its root-owned pid file.
for f in /run/slurmctld.pid /run/slurmd.pid; do
  p=$(cat "$f" 2>/dev/null || true)
  { [ -z "$p" ] || [ ! -d "/proc/$p" ]; } && rm -f "$f"
done

[ "$rc" = 0 ] && rm -f "$PIDFILE"
exit "$rc"
