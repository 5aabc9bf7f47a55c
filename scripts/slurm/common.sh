# Shared settings for scripts/slurm/{start,stop}.sh. Sourced, not executed.
# Every path can be overridden through the environment.
SLURM_CONF_DIR=${FEDFEW_SLURM_CONF_DIR:-/etc/slurm}
SLURM_CONF_FILE=$SLURM_CONF_DIR/slurm.conf
SLURM_LOG_DIR=${FEDFEW_SLURM_LOG_DIR:-/var/log/slurm}
SLURMCTLD_LOG=$SLURM_LOG_DIR/slurmctld.log
SLURMD_LOG=$SLURM_LOG_DIR/slurmd.log
SLURMCTLD_SPOOL=${FEDFEW_SLURMCTLD_SPOOL:-/var/spool/slurmctld}
SLURMD_SPOOL=${FEDFEW_SLURMD_SPOOL:-/var/spool/slurmd}
SLURMCTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PID=/run/munge/munged.pid
MUNGE_LOG=/var/log/munge/munged.log
export SLURM_CONF=$SLURM_CONF_FILE
# Daemons live in /usr/sbin, which is not always on PATH (e.g. non-login root shells).
export PATH="/usr/local/sbin:/usr/sbin:/sbin:$PATH"

# is_live PID: process exists and is not a zombie (a container's init may reap late).
is_live() {
    local st
    st=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ -n $st && $st != Z* && $st != X* ]]
}

# pid_alive PIDFILE NAME: print the pid in PIDFILE if it is a live process whose comm is NAME.
pid_alive() {
    local pidfile=$1 name=$2 pid
    pid=$( { tr -dc '0-9' <"$pidfile"; } 2>/dev/null) || return 1
    [[ -n $pid ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
    is_live "$pid" || return 1
    echo "$pid"
}

# daemon_pids NAME PIDFILE: pids of running NAME daemons (pidfile first, then exact-name match).
daemon_pids() {
    local name=$1 pidfile=$2
    local pid
    {
        pid_alive "$pidfile" "$name" || true
        pgrep -x "$name" 2>/dev/null || true
    } | sort -u | while read -r pid; do
        if [[ -n $pid ]] && is_live "$pid"; then echo "$pid"; fi
    done
    return 0
}

# stop_daemon NAME PIDFILE [TIMEOUT]: SIGTERM, wait, then SIGKILL.
stop_daemon() {
    local name=$1 pidfile=$2 timeout=${3:-15} pids i
    pids=$(daemon_pids "$name" "$pidfile")
    if [[ -z $pids ]]; then rm -f "$pidfile"; return 0; fi
    echo "[slurm] stopping $name (pid $(echo $pids))" >&2
    kill -TERM $pids 2>/dev/null || true
    for ((i = 0; i < timeout * 5; i++)); do
        pids=$(daemon_pids "$name" "$pidfile")
        [[ -z $pids ]] && break
        sleep 0.2
    done
    if [[ -n $pids ]]; then
        echo "[slurm] $name did not exit after ${timeout}s; sending SIGKILL" >&2
        kill -KILL $pids 2>/dev/null || true
        sleep 0.5
    fi
    rm -f "$pidfile"
}
