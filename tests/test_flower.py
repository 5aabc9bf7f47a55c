"""fedfew as a Flower app (src/fedfew/flower, docs/flower.md): equal to the simulator, bit for bit.

- every supported algorithm through real Flower Messages and records (the ClientApp called in
  process, :class:`~fedfew.flower.server.LocalTransport`): the same per-client accuracies, alpha,
  w, losses and server models as :class:`fedfew.simulator.simulation.Simulation`;
- Flower's simulation engine (Ray) and a real deployment (``flower-superlink`` + 4
  ``flower-supernode`` processes on localhost, each reading its own data directory): the same;
- faults: a node with a wrong partition id or a missing data directory is named by the server;
  a SuperNode killed mid-run is left out of that round with a line, rejoins and takes part again.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import compose_config
from fedfew.reporting.history_file import load_history

pytest.importorskip("flwr")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SETUP = ("dataset=digits", "num_clients=8", "logger=none", "trainer.threads=1", "trainer.accelerator=cpu",
         "save_models=true")
BIN = Path(sys.executable).parent


#: the process deployment's size (test_deployment_equals_simulator)
DEPLOY_M, DEPLOY_ROUNDS, DEPLOY_SETUP = 4, 3, ("num_clients=4", "partition.groups=2")


def _config(algorithm: str, rounds: int, *extra: str):
    return compose_config(*SETUP, f"algorithm={algorithm}", f"rounds={rounds}", *extra, tuned=True)


def _simulate(cfg, run_dir: Path) -> dict:
    """The simulator's run of ``cfg``: its fit runs at the config's trainer.threads, as the Flower
    client does (fedfew.core.threads; a matmul may round differently on 1 and 2 threads on some CPUs)."""
    from lightning.fabric import Fabric

    from fedfew.simulator.simulation import Simulation

    with contextlib.redirect_stdout(io.StringIO()):
        return Simulation(cfg, Fabric(accelerator="cpu", devices=1), run_dir).fit()


def _local(cfg, run_dir: Path) -> dict:
    from fedfew.flower.client import app
    from fedfew.flower.serve import serve
    from fedfew.flower.server import LocalTransport

    nodes = {100 + i: {"partition-id": i, "num-partitions": int(cfg.num_clients)} for i in range(int(cfg.num_clients))}
    with contextlib.redirect_stdout(io.StringIO()):
        return serve(LocalTransport(app, nodes), cfg, run_dir, engine="local")


def assert_equal_runs(ref: dict, ref_dir: Path, got: dict, got_dir: Path, tol: float = 1e-5) -> None:
    """Per-client accuracies, alpha, w, the loss matrix and the saved server models agree within ``tol``."""
    acc = np.array([c["acc"] for c in ref["clients"]])
    assert np.abs(acc - np.array([c["acc"] for c in got["clients"]])).max() <= tol
    assert [c["model"] for c in ref["clients"]] == [c["model"] for c in got["clients"]]
    for key in ("alpha", "w", "loss"):
        if ref.get(key) is not None:
            assert torch.allclose(torch.as_tensor(ref[key]).double(), torch.as_tensor(got[key]).double(), atol=tol, rtol=0)
    a, b = torch.load(ref_dir / "models.pt"), torch.load(got_dir / "models.pt")
    assert len(a) == len(b)
    for sa, sb in zip(a, b):
        assert max(float((sa[n].double() - sb[n].double()).abs().max()) for n in sa) <= tol
    assert ref["summary"]["acc_mean"] == pytest.approx(got["summary"]["acc_mean"], abs=tol)


@pytest.mark.parametrize("algorithm", ["fedfew", "fedavg"])
def test_messages_equal_simulator(algorithm, tmp_path):
    """M = 8, K = 4 (the clustered split's groups), 5 rounds: bitwise the simulator's run."""
    cfg = _config(algorithm, 5)
    ref = _simulate(cfg, tmp_path / "sim")
    got = _local(cfg, tmp_path / "flower")
    assert_equal_runs(ref, tmp_path / "sim", got, tmp_path / "flower", tol=0.0)
    if algorithm == "fedfew":
        assert got["summary"]["assignment_ari"] == 1.0 and len(got["w"][0]) == 4
    for name in ("results.json", "metrics.csv", "history.json.gz", "partition.json", "flower.json"):
        assert (tmp_path / "flower" / name).is_file()
    sim_metrics = (tmp_path / "sim" / "metrics.csv")
    assert not sim_metrics.exists() or sim_metrics.read_text().splitlines()[0] == \
        (tmp_path / "flower" / "metrics.csv").read_text().splitlines()[0]
    exchanges = json.loads((tmp_path / "flower" / "flower.json").read_text())["exchanges"]
    train = [e for e in exchanges if e["kind"] == "train"]
    assert len(train) == 5 and all(len(e["bytes_up"]) == 8 for e in train)


@pytest.mark.parametrize("algorithm", ["fedfew_reference", "fedprox", "ifca", "fedrep", "ditto", "apfl", "local",
                                       "fedmtl", "cfl", "fedsoft", "fedem", "fedmgda"])
def test_every_supported_algorithm_equal(algorithm, tmp_path):
    """Two rounds of every other supported method, bitwise equal to the simulator."""
    cfg = _config(algorithm, 2, "num_clients=4", "partition.groups=2")
    assert_equal_runs(_simulate(cfg, tmp_path / "sim"), tmp_path / "sim", _local(cfg, tmp_path / "fl"), tmp_path / "fl",
                      tol=0.0)


def test_fedbn_personal_batchnorm_stays_on_clients(tmp_path):
    cfg = _config("fedbn", 2, "num_clients=4", "partition.groups=2", "model.norm=batch")
    assert_equal_runs(_simulate(cfg, tmp_path / "sim"), tmp_path / "sim", _local(cfg, tmp_path / "fl"), tmp_path / "fl",
                      tol=0.0)


@pytest.mark.parametrize("algorithm", ["fedamp", "oracle"])
def test_refused_by_name(algorithm):
    from fedfew.flower.server import check_supported

    with pytest.raises(ValueError, match=f"algorithm={algorithm} does not run as a Flower app: "):
        check_supported(_config(algorithm, 1))


def test_partition_errors_name_id_and_directory(tmp_path):
    from fedfew.flower.partitions import PartitionError, export, load

    cfg = _config("fedavg", 1, "num_clients=4", "partition.groups=2")
    export(cfg, tmp_path / "parts")
    assert load(tmp_path / "parts" / "client_2", 2, 4, cfg).client_id == 2
    with pytest.raises(PartitionError, match=r"partition-id=3, data-dir=.*client_2: the data directory holds "
                                             r"partition 2 of 4, not partition 3 of 4"):
        load(tmp_path / "parts" / "client_2", 3, 4, cfg)
    with pytest.raises(PartitionError, match=r"partition-id=1, data-dir=.*nowhere: the data directory does not exist"):
        load(tmp_path / "nowhere", 1, 4, cfg)


def test_printed_commands_use_this_interpreter(tmp_path, capsys):
    """The commands a user copies (usage lines, the hint of a missing data directory) name the running
    interpreter, not a bare `python` that may not be the one with fedfew installed."""
    from fedfew.core.run_folders import python_command
    from fedfew.flower import deploy, partitions

    for module, main in (("fedfew.flower.deploy", deploy.main), ("fedfew.flower.partitions", partitions.main)):
        with pytest.raises(SystemExit):
            main(["--help"])
        assert capsys.readouterr().out.startswith(f"usage: {python_command(module)} ")
    with pytest.raises(partitions.PartitionError) as err:
        partitions.load(tmp_path / "nowhere", 1, 4)
    assert f"write it with `{python_command('fedfew.flower.partitions')} --out <dir>" in str(err.value)

def test_server_reports_a_broken_node(tmp_path):
    """A node with a missing data directory: the server names the node and the client's error."""
    from fedfew.flower.client import app
    from fedfew.flower.serve import serve
    from fedfew.flower.server import FederationError, LocalTransport

    cfg = _config("fedavg", 1, "num_clients=2", "partition.groups=2")
    nodes = {1: {"partition-id": 0, "num-partitions": 2},
             2: {"partition-id": 1, "num-partitions": 2, "data-dir": str(tmp_path / "missing")}}
    with pytest.raises(FederationError, match=r"clients \[1\] have no working SuperNode.*node 2: .*partition-id=1, "
                                              r"data-dir=.*missing: the data directory does not exist"):
        serve(LocalTransport(app, nodes), cfg, tmp_path / "run", connect_timeout=5)


# ---- a real deployment: flower-superlink + flower-supernode processes on localhost ------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """A ``flower-superlink`` and one ``flower-supernode`` per client (``--insecure``, localhost),
    each node reading its own data directory; every process is stopped by :meth:`close`."""

    def __init__(self, work: Path, data: Path, M: int) -> None:
        self.work, self.data, self.M = work, data, M
        self.port = _free_port()  # the SuperLink's one HTTP port (Fleet, Control and ServerAppIo APIs)
        self.env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
                    "FLWR_HOME": str(work / "flwr_home")}
        self.nodes: dict[int, subprocess.Popen] = {}
        self.superlink = self._start("superlink", [str(BIN / "flower-superlink"), "--insecure", "--host=127.0.0.1",
                                                   f"--port={self.port}"])
        deadline = time.monotonic() + 60
        while True:  # until it listens
            with socket.socket() as s, contextlib.suppress(OSError):
                s.connect(("127.0.0.1", self.port))
                break
            assert time.monotonic() < deadline, (work / "superlink.log").read_text()
            time.sleep(0.3)

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = (self.work / f"{name}.log").open("ab")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.work,
                                start_new_session=True)

    def start_node(self, pid: int, data_dir: Path | None = None) -> None:
        data_dir = data_dir or self.data / f"client_{pid}"
        self.nodes[pid] = self._start(f"node{pid}", [
            str(BIN / "flower-supernode"), "--insecure", f"--superlink=127.0.0.1:{self.port}", f"--port={_free_port()}",
            "--node-config", f"partition-id={pid} num-partitions={self.M} data-dir=\"{data_dir}\""])

    def kill_node(self, pid: int) -> None:
        os.killpg(self.nodes.pop(pid).pid, signal.SIGKILL)

    def deploy(self, run_dir: Path, *overrides: str, round_timeout: float = 0.0, timeout: float = 240) -> subprocess.Popen:
        argv = [sys.executable, "-m", "fedfew.flower.deploy", f"--superlink=127.0.0.1:{self.port}", "--insecure",
                f"--run-dir={run_dir}", f"--round-timeout={round_timeout}", "--connect-timeout=120", *overrides]
        return self._start("deploy", argv)

    def close(self) -> None:
        # the SuperLink starts each run's flwr-serverapp in a session of its own: without this, a
        # test that fails mid-run leaves that process behind, taking CPU from the tests after it
        orphans = _descendants(self.superlink.pid)
        for proc in [*self.nodes.values(), self.superlink]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: /proc/<pid>/task/<tid>/children), children first."""
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            for child in map(int, children.read_text().split()):
                found += [child, *_descendants(child)]
    return found


@pytest.fixture
def deployment(tmp_path):
    from fedfew.flower.partitions import export

    cfg = _config("fedfew", DEPLOY_ROUNDS, *DEPLOY_SETUP)
    export(cfg, tmp_path / "data")
    deployment = Deployment(tmp_path, tmp_path / "data", DEPLOY_M)
    try:
        yield deployment
    finally:
        deployment.close()


def _wait(proc: subprocess.Popen, timeout: float, work: Path) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"deployment did not finish in {timeout} s:\n" + (work / "deploy.log").read_text()[-3000:])
    assert rc == 0, (work / "deploy.log").read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_deployment_equals_simulator(deployment, tmp_path):
    """1 SuperLink + 4 SuperNodes (separate processes, own data directories; 2 client groups),
    fedfew K = 4, 3 rounds: the in-process tests above cover M = 8 and 5 rounds; this one checks
    what only processes can break (each node's own data directory, a ClientApp process per
    message), at the size that keeps the suite short (a message costs a process start)."""
    for pid in range(DEPLOY_M):
        deployment.start_node(pid)
    overrides = [o for o in SETUP if not o.startswith(("trainer.accelerator", "num_clients"))]
    _wait(deployment.deploy(tmp_path / "run", *overrides, *DEPLOY_SETUP, "algorithm=fedfew",
                            f"rounds={DEPLOY_ROUNDS}"), 360, tmp_path)
    got = json.loads((tmp_path / "run" / "results.json").read_text())
    ref = _simulate(_config("fedfew", DEPLOY_ROUNDS, *DEPLOY_SETUP), tmp_path / "sim")
    assert_equal_runs(ref, tmp_path / "sim", got, tmp_path / "run")
    assert got["summary"]["assignment_ari"] == ref["summary"]["assignment_ari"]


def _wait_for(path: Path, text: str, timeout: float, proc: subprocess.Popen) -> None:
    """Until ``text`` appears in the file ``path`` (the deploy log); fails if the run ends first."""
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        assert proc.poll() is None, f"the run ended before {text!r}:\n" + path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n" + path.read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_killed_supernode_is_left_out_and_rejoins(tmp_path):
    """A real SuperNode killed (SIGKILL) after round 1 is left out of round 2 with a line naming
    it; alpha and w are over the 3 clients that answered (alpha and each row of w sum to 1); a
    new SuperNode on the same data (started while round 2 waits for the dead one) is asked who it
    is and takes part in round 3; the run ends normally with every client scored."""
    from fedfew.flower.partitions import export

    # the timeout also bounds every round and evaluation: 4 nodes starting a clientapp each on 2 busy cores
    # took over 30 s to evaluate (CI, 2026-12-07)
    M, rounds, timeout = 4, 3, 60
    export(_config("fedfew", rounds, f"num_clients={M}"), tmp_path / "data")
    deployment = Deployment(tmp_path, tmp_path / "data", M)
    try:
        for pid in range(M):
            deployment.start_node(pid)
        overrides = [o for o in SETUP if not o.startswith(("trainer.accelerator", "num_clients"))]
        proc = deployment.deploy(tmp_path / "run", *overrides, f"num_clients={M}", "algorithm=fedfew",
                                 f"rounds={rounds}", round_timeout=timeout)
        _wait_for(tmp_path / "deploy.log", f"round 1/{rounds}", 180, proc)
        deployment.kill_node(2)
        # round 2's messages are out (node 0 received its own): the new node cannot be asked before round 3
        _wait_for(tmp_path / "node0.log", "ROUND round 2]", 150, proc)  # slow under load (2 busy cores)
        deployment.start_node(2)  # a new process on the same data: a new node id
        _wait(proc, 240, tmp_path)
    finally:
        deployment.close()
    flower_log = (tmp_path / "run" / "flower.log").read_text()
    assert "round 2: client 2 (node" in flower_log and f"left out of this train: no reply within {timeout} s" in flower_log
    assert "round 3: client 2 rejoined on node" in flower_log
    history = load_history(tmp_path / "run")["rounds"]
    assert [h["participants"] for h in history] == [[0, 1, 2, 3], [0, 1, 3], [0, 1, 2, 3]]
    assert sum(history[1]["alpha"]) == pytest.approx(1.0) and len(history[1]["alpha"]) == 3
    assert len(history[1]["w"]) == 3 and all(sum(row) == pytest.approx(1.0) for row in history[1]["w"])
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert sorted(c["id"] for c in results["clients"]) == [0, 1, 2, 3]
    assert "clients_missing" not in results["summary"]
