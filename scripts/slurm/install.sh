#!/usr/bin/env bash
# Install a single-node Slurm (Debian's slurm-wlm: slurmctld + slurmd + client) and munge.
# Idempotent: exits quickly when everything is already installed.
#
# Usage: sudo scripts/slurm/install.sh
# Exit codes: 0 ok, 1 install failed, 2 unsupported environment (not root / no apt-get).
set -euo pipefail

PKGS=(slurm-wlm slurmctld slurmd slurm-client munge)
# Binaries we need afterwards; used both for the fast path and for the final check.
BINS=(slurmctld slurmd sinfo srun sbatch squeue scancel scontrol munged munge unmunge mungekey)

export PATH="/usr/local/sbin:/usr/sbin:/sbin:$PATH"
log() { echo "[slurm/install] $*" >&2; }
die() { local code=$1; shift; log "ERROR: $*"; exit "$code"; }

all_installed() {
    local p
    for p in "${PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || return 1
    done
    local b
    for b in "${BINS[@]}"; do
        command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || return 1
    done
    return 0
}

if all_installed; then
    log "slurm-wlm and munge already installed ($(dpkg-query -W -f='${Version}' slurmctld)); nothing to do."
    exit 0
fi

[[ $(id -u) -eq 0 ]] || die 2 "must run as root to install packages (try: sudo $0)."
command -v apt-get >/dev/null 2>&1 || die 2 "apt-get not found: this script supports Debian/Ubuntu only."

export DEBIAN_FRONTEND=noninteractive
APT_INSTALL=(apt-get install -y --no-install-recommends -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)

log "installing: ${PKGS[*]}"
if ! "${APT_INSTALL[@]}" "${PKGS[@]}"; then
    log "install failed; running apt-get update and retrying"
    apt-get update || die 1 "apt-get update failed (no access to the package mirror?)."
    "${APT_INSTALL[@]}" "${PKGS[@]}" || die 1 "apt-get install ${PKGS[*]} failed."
fi

# Debian's postinst may try to start the services via systemd/invoke-rc.d; in a container
# that is harmless (and start.sh manages the daemons itself), but verify the binaries exist.
all_installed || die 1 "packages reported installed but some binaries are missing: ${BINS[*]}"
log "done: slurm $(dpkg-query -W -f='${Version}' slurmctld), munge $(dpkg-query -W -f='${Version}' munge)"
