#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, from Debian's packages, for CI and the SLURM tests.
#
#   eval "$(launchers/slurm_cluster.sh start)"   # install if needed, start munge, slurmctld and
#                                                # slurmd, wait until the node is idle; prints
#                                                # `export SLURM_CONF=...`
#   launchers/slurm_cluster.sh status
#   launchers/slurm_cluster.sh stop              # cancel all jobs, stop the daemons, remove state
#
# Needs root. The config and all state live in SLURM_STATE_DIR (default /tmp/framework-slurm);
# /etc/slurm/slurm.conf is linked to it when that path is free, so sbatch/sinfo also work
# without SLURM_CONF. Daemons end with the session that started them: start it where it is used.
set -euo pipefail

state=${SLURM_STATE_DIR:-/tmp/framework-slurm}
export SLURM_CONF=$state/slurm.conf
default_conf=/etc/slurm/slurm.conf
host=$(hostname -s)

log() { echo "slurm_cluster: $*" >&2; }
# A live (not zombie) process has the pid in file $1 (which a daemon removes as it stops).
alive() { [[ -f $1 && $(ps -o stat= -p "$(cat "$1" 2>/dev/null)" 2>/dev/null) == [^Z]* ]]; }

install_packages() {
  if command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; then
    return
  fi >/dev/null
  log "installing slurmctld slurmd slurm-client munge (apt)"
  local pkgs=(slurmctld slurmd slurm-client munge)
  export DEBIAN_FRONTEND=noninteractive
  # Lists are usually present; refresh them only when the install fails without them.
  timeout 300 apt-get install -y -q "${pkgs[@]}" >&2 ||
    { timeout 300 apt-get update -q >&2 && timeout 300 apt-get install -y -q "${pkgs[@]}" >&2; } ||
    { log "could not install ${pkgs[*]} with apt-get"; exit 1; }
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  local d
  for d in /run/munge /var/lib/munge /var/log/munge /etc/munge; do
    mkdir -p "$d" && chown munge:munge "$d"
  done
  if [[ ! -f /etc/munge/munge.key ]]; then
    mungekey -c -k /etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  runuser -u munge -- munged </dev/null >>"$state/daemons.out" 2>&1
  touch "$state/munged.ours"  # stop ends munged only if this script started it
}

write_conf() {
  mkdir -p "$state/ctld" "$state/spool"
  # More than the machine has would drain the node; 8000 MB is plenty for tests.
  local mem
  mem=$(awk '/^MemTotal:/ { m = int($2 / 1024); print (m < 8000 ? m : 8000) }' /proc/meminfo)
  cat >"$SLURM_CONF" <<EOF
ClusterName=framework
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
MailProg=/bin/true
# A requeued job may not start again before its old launch credential expires: SLURM sets its
# begin time to requeue + cred_expire + 1 s (default 120 s). 5 s keeps requeue tests short (slurmctld refuses 2 as invalid).
AuthInfo=cred_expire=5
# Nothing schedules a job the moment its begin time passes: the periodic main scheduling pass
# does (default every 60 s; backfill skips cycles when no job or node changed). Every second.
SchedulerParameters=sched_interval=1
# No cgroups here (containers, gVisor): track processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A node that was down (slurmd restarted, state lost) comes back as soon as it registers.
ReturnToService=2
# SIGTERM at the time limit or scancel, SIGKILL KillWait seconds later. slurmctld checks time
# limits every 30 s (fixed): a job ends up to 30 s after its limit, --signal=SIG@N comes N to
# N+30 s before the limit.
KillWait=30
# Finished jobs stay visible to squeue/scontrol for 5 minutes (there is no sacct database).
MinJobAge=300
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
NodeName=$host CPUs=$(nproc) RealMemory=$mem
# Up to 4 jobs share each core, whatever they ask (FORCE): on one node of a few cores a job
# would otherwise wait in the queue for any other job holding them (another test's, another
# checkout's suite, a killed test's job held to its time limit) and a test would take minutes
# longer for it; and the jobs of one sweep run side by side, as on a cluster's many nodes.
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  # The default path serves processes without SLURM_CONF; never replace a real config there.
  if [[ ! -e $default_conf || -L $default_conf ]]; then
    mkdir -p "$(dirname "$default_conf")" && ln -sfn "$SLURM_CONF" "$default_conf"
  fi
}

start() {
  [[ $(id -u) == 0 ]] || { log "needs root"; exit 1; }
  install_packages
  mkdir -p "$state"
  start_munge
  write_conf
  # Daemons detach; their early errors go to a file, so no caller's pipe is held open.
  alive "$state/slurmctld.pid" || slurmctld </dev/null >>"$state/daemons.out" 2>&1
  alive "$state/slurmd.pid" || slurmd </dev/null >>"$state/daemons.out" 2>&1
  local t
  for ((t = 0; t < 30; t++)); do
    if [[ $(sinfo -h -o %t 2>/dev/null) == idle ]]; then
      log "node $host idle after ${t}s"
      echo "export SLURM_CONF=$SLURM_CONF"
      return
    fi
    sleep 1
  done
  log "node $host not idle after 30s: sinfo says '$(sinfo -h -o %t 2>&1 || true)'"
  tail -n 20 "$state/slurmctld.log" "$state/slurmd.log" >&2 || true
  exit 1
}

stop() {
  local t f
  if [[ -f $SLURM_CONF ]] && scontrol ping >/dev/null 2>&1; then
    squeue -h -o %A | xargs -r scancel
    # Cancelled jobs get SIGTERM, then SIGKILL after KillWait: wait until they are gone.
    for ((t = 0; t < 40 && $(squeue -h | wc -l) > 0; t++)); do sleep 1; done
    scontrol shutdown >/dev/null || true
  fi
  for f in "$state/slurmd.pid" "$state/slurmctld.pid"; do
    for ((t = 0; t < 10; t++)); do alive "$f" || break; sleep 1; done
    if alive "$f"; then kill "$(cat "$f")"; fi
  done
  if [[ -f $state/munged.ours && -f /run/munge/munged.pid ]]; then
    kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
  fi
  if [[ -L $default_conf && $(readlink "$default_conf") == "$SLURM_CONF" ]]; then
    rm -f "$default_conf"
  fi
  # Only a state dir this script wrote is removed.
  if grep -qs '^ClusterName=framework$' "$SLURM_CONF"; then rm -rf "$state"; fi
  log "stopped"
}

status() {
  local d
  for d in slurmctld slurmd; do
    if alive "$state/$d.pid"; then log "$d running (pid $(cat "$state/$d.pid"))"; else log "$d not running"; fi
  done
  if [[ -f $SLURM_CONF ]] && scontrol ping >/dev/null 2>&1; then
    sinfo && squeue
    echo "export SLURM_CONF=$SLURM_CONF"
  else
    exit 1
  fi
}

case "${1:-}" in
  start | stop | status) "$1" ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
