"""Finished run folders name no machine's paths (issue 35, item 4): fedfew.experiments.portable."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from fedfew.core.run_folders import CHECKOUT
from fedfew.experiments import portable
from fedfew.experiments.launch import progress


def _run_folder(tmp_path: Path, data: Path) -> Path:
    """A run folder as fedfew.train writes it, with this checkout, the data folder and the home
    folder in its text files (the values are what a compare run records; the files are small)."""
    run = tmp_path / "cmp" / "fedavg" / "seed0"
    (run / ".hydra").mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"config": {"data_dir": str(data), "seed": 0},
                                                  "clients": [{"id": 0, "acc": 0.5}]}, indent=2))
    (run / "config.yaml").write_text(f"seed: 0\ndata_dir: {data}\n")
    (run / ".hydra" / "overrides.yaml").write_text(f"- algorithm=fedavg\n- data_dir={data}\n- optim.lr=0.5\n")
    (run / ".hydra" / "hydra.yaml").write_text(
        f"hydra:\n  run:\n    dir: {run}\n  runtime:\n    cwd: {CHECKOUT}\n    config_sources:\n"
        f"    - path: {CHECKOUT}/src/fedfew/conf\n  note: {data}2 is another folder\n")
    (run / "train.log").write_text(f"cache hit {Path.home()}/.cache/fedfew/x.pt\nread {data}/ag_news_csv/train.csv\n")
    (run / "models.pt").write_bytes(b"\x80\x04" + str(data).encode())   # binary: left as it is
    return run


def test_a_run_folder_names_no_machine_path_and_stays_the_same_run(tmp_path):
    data = tmp_path / "data"
    run = _run_folder(tmp_path, data)
    log = tmp_path / "cmp" / "logs" / "fedavg_seed0.log"
    log.parent.mkdir()
    log.write_text(f"$ {CHECKOUT}/.venv/bin/python -m fedfew.train data_dir={data} hydra.run.dir={run}\n")
    overrides = ["algorithm=fedavg", f"data_dir={data}", "optim.lr=0.5", f"hydra.run.dir={run}"]
    assert progress(run, overrides) == "done"

    changed = portable.make_portable(run, extra_files=[log])

    assert sorted(p.name for p in changed) == ["config.yaml", "fedavg_seed0.log", "hydra.yaml", "overrides.yaml",
                                               "results.json", "train.log"]
    results = json.loads((run / "results.json").read_text())          # still JSON
    assert results["config"]["data_dir"] == "<data_dir>" and results["clients"] == [{"id": 0, "acc": 0.5}]
    assert (run / "config.yaml").read_text() == "seed: 0\ndata_dir: <data_dir>\n"
    assert (run / ".hydra" / "overrides.yaml").read_text() == "- algorithm=fedavg\n- data_dir=<data_dir>\n- optim.lr=0.5\n"
    hydra = (run / ".hydra" / "hydra.yaml").read_text()
    assert "cwd: <checkout>\n" in hydra and "- path: <checkout>/src/fedfew/conf\n" in hydra
    assert f"note: {data}2 is another folder" in hydra                # a longer name is another path
    assert (run / "train.log").read_text() == "cache hit ~/.cache/fedfew/x.pt\nread <data_dir>/ag_news_csv/train.csv\n"
    assert log.read_text().startswith("$ <checkout>/.venv/bin/python -m fedfew.train data_dir=<data_dir> ")
    assert (run / "models.pt").read_bytes() == b"\x80\x04" + str(data).encode()
    # the same experiment for make compare's reuse check, from this checkout or with the data elsewhere
    assert progress(run, overrides) == "done"
    assert progress(run, [*overrides[:1], f"data_dir={tmp_path / 'copy'}", *overrides[2:]]) == "done"
    assert progress(run, ["algorithm=fedavg", f"data_dir={data}", "optim.lr=0.4"]) == "stale"
    assert portable.make_portable(run, extra_files=[log]) == []          # idempotent: nothing left to rewrite


def test_a_data_folder_inside_the_checkout_is_named_as_data(tmp_path):
    inside = CHECKOUT / "data"
    rules = portable.replacements([inside])
    assert portable.portable_text(f"data_dir: {inside}\ncwd: {CHECKOUT}\n", rules) == "data_dir: <data_dir>\ncwd: <checkout>\n"


def test_the_command_line_tool_rewrites_folders_and_refuses_what_is_not_one(tmp_path, capsys):
    data = tmp_path / "data"
    run = _run_folder(tmp_path, data)
    running = tmp_path / "cmp" / "ifca" / "seed0"                 # a run still training: no results.json yet
    (running / ".hydra").mkdir(parents=True)
    (running / "config.yaml").write_text(f"data_dir: {data}\n")
    (running / "train.log").write_text(f"read {data}/x\n")
    starting = tmp_path / "cmp" / "ditto" / "seed0"                # just started: .hydra/ only, no config.yaml yet
    (starting / ".hydra").mkdir(parents=True)
    (starting / ".hydra" / "hydra.yaml").write_text(f"cwd: {CHECKOUT}\n")
    logs = tmp_path / "cmp" / "logs"
    logs.mkdir()
    (logs / "ifca_seed0.log").write_text(f"$ python -m fedfew.train data_dir={data}\n")   # its log, being written
    old = logs / "fedavg_seed0.log"
    old.write_text(f"$ python -m fedfew.train data_dir={data}\n")
    os.utime(old, (time.time() - 3600, time.time() - 3600))        # written an hour ago: finished
    assert portable.main([str(tmp_path / "cmp")]) == 0          # a compare folder: its runs' data_dir found
    assert "6 file(s) rewritten" in capsys.readouterr().out
    assert str(data) not in (run / ".hydra" / "overrides.yaml").read_text()
    assert old.read_text() == "$ python -m fedfew.train data_dir=<data_dir>\n"
    assert (running / "train.log").read_text() == f"read {data}/x\n"
    assert (running / "config.yaml").read_text() == f"data_dir: {data}\n"
    assert (starting / ".hydra" / "hydra.yaml").read_text() == f"cwd: {CHECKOUT}\n"
    assert (logs / "ifca_seed0.log").read_text() == f"$ python -m fedfew.train data_dir={data}\n"
    with pytest.raises(SystemExit) as stop:
        portable.main([str(tmp_path / "nowhere")])
    assert stop.value.code == 2 and "not a folder" in capsys.readouterr().err


def test_committed_results_and_presets_name_no_machine_path():
    """What the repository holds under results/ and conf/tuned/ names no folder of the machine it
    is checked out on: not the checkout, not the home folder, not the data folder (issue 35, item 4;
    runs are made portable by make compare / make tune, older folders by the command-line tool)."""
    data_dirs = [CHECKOUT.parent / "shared" / "data"]
    if os.environ.get("FEDFEW_DATA_DIR"):
        data_dirs.append(Path(os.environ["FEDFEW_DATA_DIR"]))
    rules = portable.replacements([d for d in data_dirs if d.is_absolute()])
    tracked = subprocess.run(["git", "ls-files", "results", "conf/tuned"], cwd=CHECKOUT, capture_output=True,
                             text=True, check=False).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    named = [name for name in tracked if Path(name).suffix in portable.TEXT_SUFFIXES
             and (text := (CHECKOUT / name).read_text(errors="replace")) != portable.portable_text(text, rules)]
    assert not named, (f"{len(named)} committed file(s) name a folder of this machine, e.g. {named[:3]}: "
                       f"run python -m fedfew.experiments.portable on their folders")
