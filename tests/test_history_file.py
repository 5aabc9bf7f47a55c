"""fedfew.reporting.history_file: a run's history is written gzip-compressed with deterministic
bytes, read back equal, and older runs' plain history.json is still read by every reader."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from fedfew.reporting.history_file import HISTORY_FILE, PLAIN_HISTORY_FILE, history_path, load_history, write_history
from fedfew.reporting.participation import report

HISTORY = {"algorithm": "fedfew", "num_clients": 3, "K": 2,
           "rounds": [{"round": 1, "participants": [0, 2], "alpha": torch.tensor([0.25, 0.75]),
                       "w": torch.tensor([[1.0, 0.0], [0.5, 0.5]])}],
           "evaluations": [{"round": 1, "summary": {"acc_mean": 0.5}, "acc": [0.5, 0.25, 0.75], "model": [0, 1, 1]}]}
EXPECTED = {**HISTORY, "rounds": [{"round": 1, "participants": [0, 2], "alpha": [0.25, 0.75],
                                   "w": [[1.0, 0.0], [0.5, 0.5]]}]}


def test_written_gzip_read_back_equal_and_the_same_bytes_each_time(tmp_path):
    path = write_history(tmp_path / "a", HISTORY)
    assert path == tmp_path / "a" / HISTORY_FILE
    assert json.loads(gzip.decompress(path.read_bytes())) == EXPECTED   # plain gzip: zcat | jq reads it
    assert load_history(tmp_path / "a") == EXPECTED
    # no time or name in the gzip header: the same history gives the same file
    assert write_history(tmp_path / "b", HISTORY).read_bytes() == path.read_bytes()


def test_an_older_runs_plain_history_is_read_and_replaced_when_the_run_writes_again(tmp_path):
    (tmp_path / PLAIN_HISTORY_FILE).write_text(json.dumps(EXPECTED, indent=2))
    assert history_path(tmp_path) == tmp_path / PLAIN_HISTORY_FILE
    assert load_history(tmp_path) == EXPECTED
    # a resumed run writes the compressed form and leaves no second, stale history beside it
    changed = {**EXPECTED, "K": 5}
    write_history(tmp_path, changed)
    assert not (tmp_path / PLAIN_HISTORY_FILE).exists() and load_history(tmp_path) == changed


def test_missing_and_broken_histories_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"history\.json\.gz not found: is .* a fedfew run folder"):
        load_history(tmp_path)
    payload = gzip.compress(json.dumps(EXPECTED).encode(), mtime=0)
    (tmp_path / HISTORY_FILE).write_bytes(payload[: len(payload) // 2])   # cut off, as by a full disk
    with pytest.raises(ValueError, match=r"history\.json\.gz cannot be read as gzip-compressed JSON"):
        load_history(tmp_path)


def test_the_participation_report_reads_either_form(tmp_path):
    clients = [{"id": i, "model": m, "group": m, "acc": 0.5} for i, m in enumerate([0, 1, 1])]
    for folder, plain in ((tmp_path / "old", True), (tmp_path / "new", False)):
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps({"clients": clients}))
        if plain:
            (folder / PLAIN_HISTORY_FILE).write_text(json.dumps(EXPECTED))
        else:
            write_history(folder, HISTORY)
    old, new = report(tmp_path / "old"), report(tmp_path / "new")
    assert old["never_sampled"] == new["never_sampled"] == 1                    # client 1
    assert old["alpha"] == new["alpha"] and new["alpha"]["max_times_p_last"] == pytest.approx(1.5)
