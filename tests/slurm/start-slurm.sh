#!/usr/bin/env bash
# start-slurm.sh - bring up a real single-node SLURM cluster for smartckpt's tests
# (Debian 12 packages: slurm-wlm 22.05 + munge): munged, slurmctld, slurmd.
#
# Used by the session fixture in tests/test_slurm.py and by .ci/run.
#
# * Installs slurmctld, slurmd, slurm-client and munge with apt-get when missing.
# * Idempotent: if the daemons recorded in the PID file are alive they are
#   reused; only missing ones are started.  Safe to run any number of times.
# * Records "name pid starttime" of every daemon it starts in $SLURM_PIDFILE so
#   stop-slurm.sh can stop exactly those processes (by PID, never by name).
# * Exit status: 0 ready; 3 SLURM cannot be had here (not root, no apt-get, the
#   packages cannot be installed) - callers skip; anything else is a real failure.
#
# Settings that matter (see slurm.conf below): JobRequeue=1, cred_expire=10 and
# sched_interval=2 (a requeued job starts again after ~12 s instead of ~142 s),
# an explicit 127.0.0.1 address (no DNS), no cgroups (linuxproc), no accounting
# (use `scontrol show job -o ID`, not sacct), node CPUs/layout from `slurmd -C`.
#
# Knobs (environment):
#   SMARTCKPT_SLURM_DIR  base dir for pid file and logs  (default /var/tmp/smartckpt-slurm)
#   SLURM_PIDFILE     pid file                        (default $SMARTCKPT_SLURM_DIR/slurm.pids)
#   SLURM_WAIT_S      seconds to wait for node idle   (default 60)
#   SLURM_NODE_CPUS   CPUs advertised for the node    (default: nproc; > nproc oversubscribes)
#   SLURM_REAL_MEMORY_MB  node RealMemory             (default: MemTotal - 1 GiB, at least 90%)
#   SLURM_KEEP_STATE  1 = keep slurmctld/slurmd state from a previous run (default 0: wipe
#                     state when starting slurmctld from stopped, so no old jobs come back)
#   SLURM_NO_INSTALL  1 = never call apt-get (exit 3 if packages missing)
#   SLURM_STARTED_FILE  if set, this run writes there (same format as the pid file) only the
#                     daemons it started itself, so a caller that found a cluster already up
#                     (e.g. started by .ci/run) stops nothing it did not start:
#                     SLURM_PIDFILE=$SLURM_STARTED_FILE stop-slurm.sh
set -euo pipefail
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:${PATH:-}"

PROOF_DIR=${SMARTCKPT_SLURM_DIR:-/var/tmp/smartckpt-slurm}
PIDFILE=${SLURM_PIDFILE:-$PROOF_DIR/slurm.pids}
WAIT_S=${SLURM_WAIT_S:-60}
KEEP_STATE=${SLURM_KEEP_STATE:-0}
NO_INSTALL=${SLURM_NO_INSTALL:-0}
STARTED_FILE=${SLURM_STARTED_FILE:-}
if [ -n "$STARTED_FILE" ]; then : > "$STARTED_FILE"; fi

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
LOG_DIR=/var/log/slurm
CTLD_PIDF=/run/slurmctld.pid
SLURMD_PIDF=/run/slurmd.pid
MUNGE_RUN=/run/munge
MUNGE_PIDF=$MUNGE_RUN/munged.pid
MUNGE_KEY=/etc/munge/munge.key
export SLURM_CONF=$CONF   # client commands below must use our config

T0=$(date +%s%N)
log()  { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '[start-slurm %3d.%03ds] %s\n' $((ms / 1000)) $((ms % 1000)) "$*"; }
die()  { echo "start-slurm: ERROR: $*" >&2; exit 1; }
unavailable() { echo "start-slurm: SLURM unavailable: $*" >&2; exit 3; }

[ "$(id -u)" -eq 0 ] || unavailable "must run as root to install and start slurmctld/slurmd/munged"
mkdir -p "$PROOF_DIR"

# Serialize concurrent invocations.
exec 9>"$PROOF_DIR/.start-slurm.lock"
flock -w 120 9 || die "another start-slurm.sh holds $PROOF_DIR/.start-slurm.lock"

# ---------------------------------------------------------------- helpers
starttime_of() { awk '{print $22}' "/proc/$1/stat" 2>/dev/null; }
comm_of()      { cat "/proc/$1/comm" 2>/dev/null; }

# pid_alive NAME PID : true if PID is alive and its comm is NAME
pid_alive() { [ -n "${2:-}" ] && [ -d "/proc/$2" ] && [ "$(comm_of "$2")" = "$1" ]; }

# recorded_pid NAME : PID recorded in our pid file for NAME if still the same process
recorded_pid() {
  [ -f "$PIDFILE" ] || return 1
  local n p st
  while read -r n p st; do
    [ "$n" = "$1" ] || continue
    if pid_alive "$n" "$p" && [ "$(starttime_of "$p")" = "$st" ]; then echo "$p"; return 0; fi
  done < "$PIDFILE"
  return 1
}

record_pid() {  # NAME PID
  local tmp line; tmp=$(mktemp "$PROOF_DIR/.pids.XXXX")
  [ -f "$PIDFILE" ] && grep -v "^$1 " "$PIDFILE" > "$tmp" || true
  line="$1 $2 $(starttime_of "$2")"
  echo "$line" >> "$tmp"
  mv "$tmp" "$PIDFILE"
  if [ -n "$STARTED_FILE" ]; then echo "$line" >> "$STARTED_FILE"; fi
}

forget_pid() {  # NAME
  [ -f "$PIDFILE" ] || return 0
  local tmp; tmp=$(mktemp "$PROOF_DIR/.pids.XXXX")
  grep -v "^$1 " "$PIDFILE" > "$tmp" || true
  mv "$tmp" "$PIDFILE"
}

# wait_pidfile NAME FILE SECS : wait until FILE names a live NAME process; echo pid
wait_pidfile() {
  local i p
  for ((i = 0; i < $3 * 10; i++)); do
    p=$(cat "$2" 2>/dev/null || true)
    if pid_alive "$1" "$p"; then echo "$p"; return 0; fi
    sleep 0.1
  done
  return 1
}

# launch LOGFILE CMD... : run CMD (a self-daemonizing program) with stdin from
# /dev/null, stdout/stderr appended to LOGFILE and every other inherited fd
# closed.  Otherwise the daemons inherit our lock fd and the caller's pipes
# (a test harness reading our output would then never see EOF).
launch() {
  local out=$1; shift
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      [ "$fd" -gt 2 ] 2>/dev/null && eval "exec $fd>&-" 2>/dev/null
    done
    exec "$@" < /dev/null >> "$out" 2>&1
  )
}

stop_pid() {  # NAME PID : TERM, then KILL after 15 s
  local i
  kill -TERM "$2" 2>/dev/null || return 0
  for ((i = 0; i < 150; i++)); do pid_alive "$1" "$2" || return 0; sleep 0.1; done
  kill -KILL "$2" 2>/dev/null || true
}

# ---------------------------------------------------------------- 1. packages
need_install=0
for b in munged munge slurmctld slurmd sbatch sinfo scontrol; do
  command -v "$b" >/dev/null 2>&1 || need_install=1
done
if [ "$need_install" = 1 ]; then
  [ "$NO_INSTALL" = 1 ] && unavailable "slurm/munge binaries missing and SLURM_NO_INSTALL=1"
  command -v apt-get >/dev/null 2>&1 || unavailable "slurm/munge binaries missing and no apt-get to install them"
  log "installing slurmctld slurmd slurm-client munge via apt-get"
  export DEBIAN_FRONTEND=noninteractive
  pkgs=(slurmctld slurmd slurm-client munge)
  if ! apt-get install -y -q --no-install-recommends "${pkgs[@]}" > "$PROOF_DIR/apt.log" 2>&1; then
    apt-get update -q >> "$PROOF_DIR/apt.log" 2>&1 || true
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >> "$PROOF_DIR/apt.log" 2>&1 \
      || { tail -20 "$PROOF_DIR/apt.log" >&2; unavailable "apt-get install ${pkgs[*]} failed (no network or no package source? see $PROOF_DIR/apt.log)"; }
  fi
  log "packages installed"
fi
id slurm >/dev/null 2>&1 || die "user 'slurm' missing (should be created by slurm-wlm packages)"
id munge >/dev/null 2>&1 || die "user 'munge' missing (should be created by munge package)"

# ---------------------------------------------------------------- 2. munge
# munged is strict about permissions: key 0400/0600 owned by munge, /etc/munge
# not group/other writable, log/lib/run dirs owned by munge.
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 "$MUNGE_RUN"
if [ ! -s "$MUNGE_KEY" ]; then
  log "creating munge key"
  if command -v mungekey >/dev/null 2>&1; then
    runuser -u munge -- mungekey --create --keyfile="$MUNGE_KEY" --force
  else
    dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
  fi
fi
chown munge:munge "$MUNGE_KEY"; chmod 0400 "$MUNGE_KEY"

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if p=$(recorded_pid munged) && munge_ok; then
  log "munged already running (pid $p, ours)"
elif munge_ok; then
  log "a munged not started by this script is answering on $MUNGE_RUN/munge.socket.2; reusing it"
else
  forget_pid munged
  rm -f "$MUNGE_PIDF"
  log "starting munged"
  launch "$PROOF_DIR/munged.stdout" runuser -u munge -- /usr/sbin/munged \
    || { tail -5 /var/log/munge/munged.log >&2 || true; die "munged failed to start"; }
  p=$(wait_pidfile munged "$MUNGE_PIDF" 10) || die "munged pid file $MUNGE_PIDF not written"
  record_pid munged "$p"
  for i in $(seq 1 50); do munge_ok && break; sleep 0.1; done
  munge_ok || { tail -5 /var/log/munge/munged.log >&2 || true; die "munge -n | unmunge fails"; }
  log "munged up (pid $p)"
fi

# ---------------------------------------------------------------- 3. slurm.conf
NODE=$(hostname -s 2>/dev/null || true)
[ -n "$NODE" ] || NODE=localhost
# What slurmd itself sees (CPUs and socket/core/thread layout): a node line that
# disagrees with it makes slurmctld mark the node invalid.
HW=$(slurmd -C 2>/dev/null | head -1 || true)
NCPU=$(echo "$HW" | grep -o 'CPUs=[0-9]*' | cut -d= -f2 || true)
[ -n "$NCPU" ] || NCPU=$(nproc)
CPUS=${SLURM_NODE_CPUS:-$NCPU}
MEM_MB=${SLURM_REAL_MEMORY_MB:-$(awk '/^MemTotal:/ {m=int($2/1024); r=m-1024; if (r < m*0.9) r=int(m*0.9); print r}' /proc/meminfo)}
TOPO=""
OVERRIDE=""
if [ "$CPUS" = "$NCPU" ]; then
  TOPO=$(echo "$HW" | grep -o 'Boards=[0-9]* SocketsPerBoard=[0-9]* CoresPerSocket=[0-9]* ThreadsPerCore=[0-9]*' || true)
else
  # Advertising more CPUs than present (more concurrent test jobs) needs config_overrides.
  OVERRIDE="SlurmdParameters=config_overrides"
fi

NEWCONF=$(mktemp)
cat > "$NEWCONF" <<EOF
# Generated by smartckpt tests/slurm/start-slurm.sh - single-node test cluster. Do not edit by hand.
ClusterName=smartckpt
# Explicit address: no DNS / /etc/hosts lookup of the host name is needed.
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=slurm
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job must wait before it may start
# again (default 120 s); 10 s keeps requeue tests fast.
AuthInfo=cred_expire=10
StateSaveLocation=${STATE_DIR}
SlurmdSpoolDir=${SPOOL_DIR}
SlurmctldPidFile=${CTLD_PIDF}
SlurmdPidFile=${SLURMD_PIDF}
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: portable to sandboxes/containers where cgroups are unusable.
# (Caveat: linuxproc cannot track processes that daemonize / are orphaned.)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
# Seconds between SIGTERM and SIGKILL when a job is cancelled or requeued.
KillWait=10
${OVERRIDE}
NodeName=${NODE} NodeHostname=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} ${TOPO} RealMemory=${MEM_MB} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
install -d -m 0755 "$CONF_DIR"
CONF_CHANGED=0
if ! cmp -s "$NEWCONF" "$CONF"; then
  CONF_CHANGED=1
  install -m 0644 "$NEWCONF" "$CONF"
  log "wrote $CONF"
fi
rm -f "$NEWCONF"

# ---------------------------------------------------------------- 4. dirs
install -d -o slurm -g slurm -m 0755 "$STATE_DIR" "$LOG_DIR"
install -d -o root -g root -m 0755 "$SPOOL_DIR"

# ---------------------------------------------------------------- 5. daemons
CTLD_PID=$(recorded_pid slurmctld || true)
SLURMD_PID=$(recorded_pid slurmd || true)

if [ "$CONF_CHANGED" = 1 ] && { [ -n "$CTLD_PID" ] || [ -n "$SLURMD_PID" ]; }; then
  log "slurm.conf changed: restarting our slurm daemons"
  [ -n "$SLURMD_PID" ] && stop_pid slurmd "$SLURMD_PID"
  [ -n "$CTLD_PID" ] && stop_pid slurmctld "$CTLD_PID"
  forget_pid slurmd; forget_pid slurmctld
  CTLD_PID=""; SLURMD_PID=""
  KEEP_STATE=1   # jobs may still be running under slurmstepd: keep their state
fi

# A slurmctld/slurmd we did not start would collide on ports 6817/6818.
for d in slurmctld:$CTLD_PIDF slurmd:$SLURMD_PIDF; do
  n=${d%%:*}; f=${d#*:}; p=$(cat "$f" 2>/dev/null || true)
  mine=$([ "$n" = slurmctld ] && echo "$CTLD_PID" || echo "$SLURMD_PID")
  if [ -z "$mine" ] && pid_alive "$n" "$p"; then
    die "a $n not started by this script is running (pid $p, $f); stop it first"
  fi
done

if [ -n "$CTLD_PID" ]; then
  log "slurmctld already running (pid $CTLD_PID)"
else
  forget_pid slurmctld
  rm -f "$CTLD_PIDF"
  if [ "$KEEP_STATE" != 1 ]; then
    # Fresh controller state: no jobs from an earlier run come back.
    find "$STATE_DIR" -mindepth 1 -delete
    if [ -z "$SLURMD_PID" ]; then find "$SPOOL_DIR" -mindepth 1 -delete; fi
  fi
  log "starting slurmctld"
  launch "$LOG_DIR/slurmctld.stdout" /usr/sbin/slurmctld \
    || { tail -20 "$LOG_DIR/slurmctld.log" >&2 || true; die "slurmctld failed to start"; }
  CTLD_PID=$(wait_pidfile slurmctld "$CTLD_PIDF" 15) \
    || { tail -20 "$LOG_DIR/slurmctld.log" >&2 || true; die "slurmctld did not stay up"; }
  record_pid slurmctld "$CTLD_PID"
  log "slurmctld up (pid $CTLD_PID)"
fi

ok=0
for i in $(seq 1 100); do timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP' && { ok=1; break; }; sleep 0.1; done
[ "$ok" = 1 ] || { tail -20 "$LOG_DIR/slurmctld.log" >&2 || true; die "slurmctld does not answer 'scontrol ping'"; }

if [ -n "$SLURMD_PID" ]; then
  log "slurmd already running (pid $SLURMD_PID)"
else
  forget_pid slurmd
  rm -f "$SLURMD_PIDF"
  log "starting slurmd"
  launch "$LOG_DIR/slurmd.stdout" /usr/sbin/slurmd -N "$NODE" \
    || { tail -20 "$LOG_DIR/slurmd.log" >&2 || true; die "slurmd failed to start"; }
  SLURMD_PID=$(wait_pidfile slurmd "$SLURMD_PIDF" 15) \
    || { tail -20 "$LOG_DIR/slurmd.log" >&2 || true; die "slurmd did not stay up"; }
  record_pid slurmd "$SLURMD_PID"
  log "slurmd up (pid $SLURMD_PID)"
fi

# ---------------------------------------------------------------- 6. wait for idle
deadline=$(( $(date +%s) + WAIT_S ))
resumed=0
state=""
while :; do
  state=$(timeout 5 sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -1 || true)
  case "$state" in
    idle|mixed|allocated|completing) break ;;
    down*|drain*|fail*|inval*)
      # e.g. "Node unexpectedly rebooted" after restarting with kept state
      if [ "$resumed" = 0 ]; then
        log "node state '$state' -> scontrol update state=resume"
        timeout 5 scontrol update nodename="$NODE" state=resume 2>/dev/null || true
        resumed=1
      fi ;;
  esac
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "start-slurm: ERROR: node $NODE not idle after ${WAIT_S}s (state='${state:-?}')" >&2
    timeout 5 sinfo -N -l >&2 || true
    timeout 5 scontrol show node "$NODE" 2>/dev/null | grep -E 'State|Reason' >&2 || true
    echo "--- slurmctld.log (tail)" >&2; tail -15 "$LOG_DIR/slurmctld.log" >&2 || true
    echo "--- slurmd.log (tail)" >&2;    tail -15 "$LOG_DIR/slurmd.log" >&2 || true
    exit 1
  fi
  sleep 0.2
done
log "node $NODE is $state; cluster ready (pids: $(tr '\n' ';' < "$PIDFILE" 2>/dev/null))"
sinfo
