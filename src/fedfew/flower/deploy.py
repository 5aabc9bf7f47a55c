"""``python -m fedfew.flower.deploy --superlink HOST:PORT [--insecure | --root-certificates CA]
[--run-dir DIR] [--round-timeout S] [hydra overrides]``: submit a fedfew run to a running
SuperLink with ``flwr run`` and wait for it to finish (docs/flower.md).

It writes the Flower App (a ``pyproject.toml`` whose components are
``fedfew.flower.serve:app`` and ``fedfew.flower.client:app``: the code itself comes from the
fedfew installed beside Flower on the SuperLink's and the SuperNodes' machines) and a Flower
configuration naming the SuperLink's address (``$FLWR_HOME/config.toml``) into a scratch
folder, then runs ``flwr run <app> fedfew --stream --run-config 'overrides=... run-dir=...'``.
The ServerApp composes the run config from the overrides on the SuperLink's machine and writes
the run folder there.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from fedfew.core.run_folders import python_command

PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedfew-flower"
version = "0.1.0"
description = "fedfew (FedFew and the PFL baselines) as a Flower app: components from the installed fedfew package"
license = "MIT"
dependencies = []

[tool.flwr.app]
publisher = "fedfew"

[tool.flwr.app.components]
serverapp = "fedfew.flower.serve:app"
clientapp = "fedfew.flower.client:app"

[tool.flwr.app.config]
overrides = ""
run-dir = ""
round-timeout = 0.0
connect-timeout = 300.0
"""


def write_app(folder: Path) -> Path:
    """The Flower App folder (its ``pyproject.toml``) in ``folder``; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(PYPROJECT, encoding="utf-8")
    return folder


def write_connection(flwr_home: Path, address: str, insecure: bool, root_certificates: str | None) -> Path:
    """``flwr_home/config.toml`` with one SuperLink connection ``fedfew`` (the default)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", 'default = "fedfew"', "", "[superlink.fedfew]", f"address = {json.dumps(address)}"]
    lines.append("insecure = true" if insecure else f"root-certificates = {json.dumps(str(root_certificates))}")
    path = flwr_home / "config.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_config(overrides: list[str], run_dir: str, round_timeout: float, connect_timeout: float) -> str:
    """The ``--run-config`` value: TOML ``key=value`` pairs."""
    return " ".join([f"overrides={json.dumps(' '.join(shlex.quote(o) for o in overrides))}",
                     f"run-dir={json.dumps(run_dir)}", f"round-timeout={float(round_timeout)}",
                     f"connect-timeout={float(connect_timeout)}"])


def command(app: Path, config: str) -> list[str]:
    """The ``flwr run`` command line (the ``flwr`` beside this interpreter)."""
    flwr = Path(sys.executable).with_name("flwr")
    return [str(flwr) if flwr.exists() else "flwr", "run", str(app), "fedfew", "--stream", "--run-config", config]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=python_command("fedfew.flower.deploy"), description=__doc__.split("\n\n")[0])
    parser.add_argument("--superlink", default="127.0.0.1:8000", help="the SuperLink's HTTP address (HOST:PORT)")
    tls = parser.add_mutually_exclusive_group(required=True)
    tls.add_argument("--insecure", action="store_true", help="no TLS (localhost tests only)")
    tls.add_argument("--root-certificates", help="the CA certificate the SuperLink's certificate is signed with")
    parser.add_argument("--run-dir", default="", help="run folder on the SuperLink's machine (absolute)")
    parser.add_argument("--round-timeout", type=float, default=0.0, help="seconds to wait for a round's replies (0: all)")
    parser.add_argument("--connect-timeout", type=float, default=300.0, help="seconds to wait for every client's node")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for make train")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedfew-flower-") as scratch:
        app = write_app(Path(scratch) / "app")
        home = Path(scratch) / "flwr_home"
        write_connection(home, args.superlink, args.insecure, args.root_certificates)
        env = {**os.environ, "FLWR_HOME": str(home)}
        cmd = command(app, run_config(args.overrides, args.run_dir, args.round_timeout, args.connect_timeout))
        print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
        return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
