#!/usr/bin/env bash
# Stop the single-node Slurm cluster started by scripts/slurm/start.sh:
# cancel all jobs, then stop slurmd, slurmctld and munged. Safe to run when nothing is running.
#
# Usage: sudo scripts/slurm/stop.sh [--keep-munge]
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"

KEEP_MUNGE=0
[[ ${1:-} == --keep-munge ]] && KEEP_MUNGE=1
if [[ $(id -u) -ne 0 ]]; then
    echo "[slurm/stop] ERROR: must run as root (try: sudo $0)" >&2
    exit 2
fi

if [[ -n $(daemon_pids slurmctld "$SLURMCTLD_PID") ]] && command -v scancel >/dev/null 2>&1; then
    echo "[slurm/stop] cancelling all jobs" >&2
    timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
    # Jobs of other users, if any.
    for u in $(timeout 10 squeue -h -o '%u' 2>/dev/null | sort -u); do
        timeout 10 scancel --quiet --user="$u" 2>/dev/null || true
    done
    for _ in $(seq 20); do
        [[ -z $(timeout 5 squeue -h -t RUNNING,COMPLETING -o '%i' 2>/dev/null) ]] && break
        sleep 0.5
    done
fi
stop_daemon slurmd "$SLURMD_PID"
stop_daemon slurmctld "$SLURMCTLD_PID"
(( KEEP_MUNGE )) || stop_daemon munged "$MUNGE_PID" 5
echo "[slurm/stop] stopped" >&2
