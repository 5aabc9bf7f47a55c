#!/usr/bin/env bash
# GPU readiness check (`make gpu-check`; docs/speed.md): one command, from a bare machine.
#
#   1. packages: installs the wheels carried in .gpu_wheels/ (`make gpu-wheels`) offline into a
#      temporary folder put on PYTHONPATH, skipping those installed already at the same version
#      and those not built for this Python;
#   2. data: CIFAR-10 tarballs from .gpu_data/cifar10 (`make gpu-data`), else from the data
#      directory ($FEDFEW_DATA_DIR/cifar10 or ../shared/data/cifar10); synthetic tensors without;
#   3. runs `python -m fedfew.bench --gpu-check` with PYTHONPATH=src (the project need not be
#      installed) and writes bench.json and bench.md into $OUT when set, else outputs/bench/.
#
# On a machine with a GPU it measures every CUDA path within 420 s of this script's start (7 minutes); without
# one it runs the CPU smoke mode (the same code paths at tiny sizes, under a minute).
# Arguments go to fedfew.bench (e.g. --device cpu, --budget 300, --only correctness speed).
# Environment: GPU_CHECK_PYTHON (default .venv/bin/python when present, else python3),
# GPU_WHEELS_DIR (default .gpu_wheels), GPU_DATA_DIR (default .gpu_data), OUT.
set -euo pipefail
started=$(date +%s)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

py="${GPU_CHECK_PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
out="${OUT:-outputs/bench}"
wheels="${GPU_WHEELS_DIR:-.gpu_wheels}"
gpu_data="${GPU_DATA_DIR:-.gpu_data}"
echo "[gpu-check] $("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])'); output: $out"

# ---- 1. packages --------------------------------------------------------------------------------
site=""
cleanup() { if [ -n "$site" ]; then rm -rf "$site"; fi; }
trap cleanup EXIT
if compgen -G "$wheels/*.whl" > /dev/null; then
    site="$(mktemp -d "${TMPDIR:-/tmp}/fedfew-gpu-site.XXXXXX")"
    # which carried wheels this interpreter needs (one path a line; reasons on stderr)
    mapfile -t todo < <("$py" - "$wheels" <<'PY'
import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import parse_wheel_filename

supported = set(sys_tags())
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, version, _build, tags = parse_wheel_filename(wheel.name)
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if have == str(version):
        print(f"[gpu-check] {name} {have}: installed already", file=sys.stderr)
    elif not tags & supported:
        print(f"[gpu-check] {wheel.name}: not built for this Python, skipped", file=sys.stderr)
    else:
        note = f" (shadows the installed {have})" if have else ""
        print(f"[gpu-check] {name} {version}: from {wheel}{note}", file=sys.stderr)
        print(wheel)
PY
    )
    if [ "${#todo[@]}" -gt 0 ]; then
        t0=$(date +%s)
        if "$py" -m pip --version > /dev/null 2>&1; then
            "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
                --target "$site" "${todo[@]}"
        else  # no pip: every carried wheel is pure Python, and a pure wheel unpacks as it installs
            "$py" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
                "$site" "${todo[@]}"
        fi
        echo "[gpu-check] installed ${#todo[@]} wheel(s) into $site in $(( $(date +%s) - t0 )) s"
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "[gpu-check] no wheels in $wheels/ (make gpu-wheels): using the installed packages"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
missing="$("$py" -c 'import importlib.util as u
print(" ".join(m for m in ("torch", "lightning", "hydra", "omegaconf", "antlr4") if u.find_spec(m) is None))')"
if [ -n "$missing" ]; then
    echo "[gpu-check] error: cannot import $missing; run \`make gpu-wheels\` where pip works and carry $wheels/" \
         "to this machine" >&2
    exit 2
fi

# ---- 2. data ------------------------------------------------------------------------------------
cifar=""
for dir in "$gpu_data/cifar10" "${FEDFEW_DATA_DIR:+$FEDFEW_DATA_DIR/cifar10}" ../shared/data/cifar10; do
    if [ -n "$dir" ] && [ -f "$dir/cifar10_train_jpg.tar.gz" ] && [ -f "$dir/cifar10_test_jpg.tar.gz" ]; then
        cifar="$dir"
        break
    fi
done
if [ -z "$cifar" ]; then
    echo "[gpu-check] no CIFAR-10 tarballs in $gpu_data/cifar10 (make gpu-data) nor the data directory:" \
         "synthetic CIFAR-10-shaped tensors stand in (accuracy at chance)"
fi

# ---- 3. the check -------------------------------------------------------------------------------
status=0
"$py" -m fedfew.bench --gpu-check --out "$out" --started-at "$started" ${cifar:+--cifar-dir "$cifar"} "$@" || status=$?
echo "[gpu-check] finished in $(( $(date +%s) - started )) s (exit code $status); results in $out/bench.md"
exit "$status"
