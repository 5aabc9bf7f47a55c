"""make tune (fedfew.tune, issue #16): bad input is refused before any run; every algorithm has
a search space that exists in its config; the study is reproducible, resumes without redoing
finished trials and re-runs an interrupted one; presets record their provenance and apply
(optim.lr included); and tuning never reads the test split: shuffling the test labels changes
nothing it chooses."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedfew import tune
from fedfew.experiments import comparison
from fedfew.experiments import preset_files
from fedfew.config import presets
from fedfew.experiments import search_space
from fedfew.experiments import studies
from fedfew.experiments import tuning
from fedfew.algorithms import ALGORITHMS
from fedfew.experiments.search_space import Dimension
from fedfew.experiments.tune_errors import TuneError

from conftest import compose_config

ROOT = Path(__file__).resolve().parents[1]

FAKE_TRAIN = '''
import json, math, os, sys
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and not a.startswith("~"))
run_dir = args["hydra.run.dir"]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(run_dir + (" resume=" + args["resume"] if "resume" in args else "") + "\\n")
lr = float(args.get("optim.lr", 0.3))   # the digits config's lr when the trial runs the defaults
if lr > float(os.environ.get("FAKE_FAIL_ABOVE", "inf")) or args["algorithm"] == os.environ.get("FAKE_FAIL"):
    print("diverged on purpose"); sys.exit(1)
if "resume" in args and os.environ.get("FAKE_REFUSE"):      # as fedfew.train refusing a changed config
    print("error: resume: this run's config differs from the one the checkpoint was written with"); sys.exit(2)
if args["algorithm"] == os.environ.get("FAKE_SIGNAL") and "resume" not in args:   # Ctrl-C after a checkpoint
    os.makedirs(os.path.join(run_dir, "checkpoints"), exist_ok=True)
    open(os.path.join(run_dir, "checkpoints", "last.ckpt"), "w").write("stand-in")
    sys.exit(130)
assert args["eval.split"] == "val" and float(args["partition.val_fraction"]) > 0 and args["logger"] == "none"
acc = 1.0 - abs(math.log(lr / 0.1)) / 10          # best at lr = 0.1
os.makedirs(run_dir, exist_ok=True)
# above FAKE_NAN_ABOVE an lr scores best, and a local copy goes non-finite (on seed FAKE_NAN_SEED only, when set)
nonfinite = {"clients": {}, "diverged_rounds": [], "stopped_at": None, "verdict": "finite"}
if lr > float(os.environ.get("FAKE_NAN_ABOVE", "inf")):
    acc = 0.99
if lr > float(os.environ.get("FAKE_NAN_ABOVE", "inf")) and os.environ.get("FAKE_NAN_SEED", args["seed"]) == args["seed"]:
    nonfinite = {"clients": {"2": {"first_round": 2, "last_round": 3, "rounds": 2, "what": ["local copy of model 0"]}},
                 "diverged_rounds": [], "stopped_at": None, "verdict": "nonfinite"}
    if os.environ.get("FAKE_STOP"):  # every client non-finite: the run stops early (fedfew.core.nonfinite)
        nonfinite.update(diverged_rounds=[1, 2, 3], stopped_at=3, verdict="diverged")
evals = [{"round": r, "acc_mean": acc - 0.01 * (3 - r)} for r in (1, 2, 3)]
with open(os.path.join(run_dir, "results.json"), "w") as f:
    json.dump({"summary": {"acc_mean": acc, "eval_split": "val", "verdict": nonfinite["verdict"]},
               "evaluations": evals, "nonfinite": nonfinite}, f)
if nonfinite["stopped_at"] is not None:
    sys.exit(3)
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A stand-in for python -m fedfew.train that scores lr without training (fast)."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    log = tmp_path / "invocations.log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    return [sys.executable, str(script)], log


def argv(out, trials, *more, algorithms=("fedavg",), jobs=1):
    return ["--dataset", "digits", "--algorithms", *algorithms, "--trials", str(trials), "--jobs", str(jobs),
            "--out", str(out), "--install", "no", *more, "--", "partition=dirichlet", "num_clients=4", "rounds=3"]


def load(out, algorithm="fedavg"):
    import optuna

    return optuna.load_study(study_name=f"digits_{algorithm}", storage=f"sqlite:///{out / algorithm / 'study.db'}")


def left_running(out, algorithm="fedavg"):
    """A trial asked and given its lr, never told: what a killed tune leaves in its study."""
    trial = load(out, algorithm).ask()
    trial.suggest_float("optim.lr", 0.06, 2.4, log=True)  # the search range of conf/tune/common.yaml on digits
    return trial


def trial_values(out, algorithm="fedavg"):
    """(values, score) of every finished sampled trial, then the config defaults' score."""
    from optuna.trial import TrialState

    study = load(out, algorithm)
    sampled = [(t.user_attrs["values"], t.value) for t in study.get_trials(states=(TrialState.COMPLETE,))]
    return sampled + [study.user_attrs.get("defaults", {}).get("value")]


def test_bad_input_is_refused_before_any_run(tmp_path, fake, monkeypatch):
    command, log = fake
    out = tmp_path / "out"
    cases = [
        (["--algorithms", "nosuch"], "unknown algorithm"),
        (["--algorithms", "fedavg", "--val-fraction", "0"], "--val-fraction=0.0"),
        (["--algorithms", "fedavg", "--trials", "0"], "--trials"),
        (["--algorithms", "fedavg", "--", "optim.lr=0.1"], "empty search space for fedavg"),
        (["--algorithms", "fedavg", "--", "partition.val_fraction=0.3"], "set by the tune"),
        (["--algorithms", "fedavg", "--", "eval.split=test"], "set by the tune"),
        (["--algorithms", "fedavg", "--", "algorithm.nosuch=1"], "unknown config key"),
        (["--algorithms", "fedavg", "fedavg"], "listed twice"),
    ]
    for args, needle in cases:
        with pytest.raises(TuneError, match=needle):
            tune.main(["--out", str(out), "--install", "no", *args], command=command)
    space = tmp_path / "space"
    space.mkdir()
    (space / "common.yaml").write_text("optim.lr: {low: 0.1, high: 2.0, log: true, scale: dataset.lr}\n")
    monkeypatch.setattr(search_space, "SPACE_DIR", space)
    with pytest.raises(TuneError, match="no search space for algorithm fedavg"):
        tune.main(argv(out, 2), command=command)
    assert not out.exists() and not log.exists()  # nothing ran, nothing was written


def test_the_default_list_leaves_out_what_cannot_run_and_a_named_one_is_an_error(tmp_path):
    args = tune.parse_args(["--out", str(tmp_path), "--", "partition=dirichlet"])
    names = [p.algorithm for p in tuning.plans(args)]
    assert "oracle" not in names and {"fedfew", "fedavg", "fedrep"} <= set(names)   # oracle needs client groups
    with pytest.raises(TuneError, match="oracle.*use partition=clustered"):
        tuning.plans(tune.parse_args(["--algorithms", "oracle", "--out", str(tmp_path), "--", "partition=dirichlet"]))
    assert not tmp_path.joinpath("oracle").exists()
    # a key only the named method defines is its own (fedfew, the config default, lacks it): fixed, not searched
    plan, = tuning.plans(tune.parse_args(["--algorithms", "fedprox", "--out", str(tmp_path), "--", "algorithm.mu_prox=0.05"]))
    assert [d.key for d in plan.space] == ["optim.lr"] and plan.cfg.algorithm.mu_prox == 0.05


def test_the_default_folder_names_the_setup_and_points_to_an_older_one(tmp_path, monkeypatch, capsys):
    """Without --out, tunes of different setups get different folders (as make compare's do), under
    $FEDFEW_OUTPUT_DIR; threads and paths do not change the name."""
    monkeypatch.setenv("FEDFEW_OUTPUT_DIR", str(tmp_path))
    plan = tuning.plans(tune.parse_args(["--algorithms", "fedavg", "--", "partition=pathological", "trainer.threads=1"]))
    assert [p.out for p in plan] == [tmp_path / "tune" / "digits_partition-pathological"]
    assert tuning.plans(tune.parse_args(["--algorithms", "fedavg"]))[0].out == tmp_path / "tune" / "digits"
    # a study in the folder every setup used before is pointed to, and nothing is started before the note
    (tmp_path / "tune" / "digits" / "fedavg").mkdir(parents=True)
    (tmp_path / "tune" / "digits" / "fedavg" / "study.db").write_bytes(b"")
    from fedfew.core.run_folders import older_setup_folder

    new = tmp_path / "tune" / "digits_partition-pathological"
    assert older_setup_folder("tune", "digits", new, "*/study.db") == tmp_path / "tune" / "digits"
    assert older_setup_folder("tune", "digits", tmp_path / "tune" / "digits", "*/study.db") is None
    from fedfew.core.run_folders import older_setup_note

    assert older_setup_note("tune", "digits", new) == (
        f"note: {tmp_path / 'tune' / 'digits'} holds a tune made before the default folder named its setup; "
        f"to continue it, pass TUNE_OUT={tmp_path / 'tune' / 'digits'} (--out)")
    new.mkdir()  # once the new folder exists it is the one in use: no note
    assert older_setup_folder("tune", "digits", new, "*/study.db") is None and older_setup_note("tune", "digits", new) is None


def test_malformed_dimensions_are_named():
    src = Path("x.yaml")
    for spec, needle in [({"low": 1, "high": 0.5}, "low < high"), ({"low": 0, "high": 1, "log": True}, "low > 0"),
                         ({"low": 1}, "numeric low and high"), ({"low": 1, "high": 2, "type": "str"}, "type='str'"),
                         ({"choices": [1]}, "at least two"), ({"lo": 1, "high": 2}, "unknown field"), (3, "mapping")]:
        with pytest.raises(TuneError, match=needle):
            Dimension.parse("algorithm.mu", spec, src)


def test_every_algorithm_has_a_search_space_that_its_config_holds():
    for alg in ALGORITHMS.names():
        overrides = ["partition=clustered"] if alg == "oracle" else ["partition=dirichlet"]
        cfg = compose_config(f"algorithm={alg}", "~tuned", *overrides)
        dims = [d.resolve(cfg) for d in search_space.load_space(alg)]
        lr = next(d for d in dims if d.key == "optim.lr")   # every method searches the local lr, the same way
        assert (lr.low, lr.high, lr.log) == (pytest.approx(0.2 * cfg.dataset.lr), pytest.approx(8 * cfg.dataset.lr), True)
        for d in dims:
            value = d.suggest(_Fixed(d))
            assert d.low <= value <= d.high if d.kind != "categorical" else value in d.choices


class _Fixed:
    """An Optuna trial stand-in that suggests the geometric/arithmetic middle of a range."""

    def __init__(self, dim):
        self.dim = dim

    def suggest_float(self, name, low, high, log=False):
        return math.sqrt(low * high) if log else (low + high) / 2

    def suggest_int(self, name, low, high, log=False):
        return (low + high) // 2

    def suggest_categorical(self, name, choices):
        return choices[0]


def test_study_is_reproducible_resumes_and_writes_a_preset(tmp_path, fake, monkeypatch):
    command, log = fake
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert tune.main(argv(whole, 5), command=command) == 0
    assert "total wall time of this invocation: " in (whole / "tune.md").read_text()   # it trained
    assert tune.main(argv(parts, 3), command=command) == 0
    first = log.read_text().splitlines()
    # sampled trials and the config defaults on seed 0, then the best confirmed on seed 1 and run at 1.5x its lr
    assert len(first) == (5 + 1 + 2) + (3 + 1 + 2)
    assert sum("/seed1" in line for line in first) == 2 and sum("_lr1.5x/seed0" in line for line in first) == 2
    best_of_3 = studies.choice(load(parts)).label
    assert tune.main(argv(parts, 5), command=command) == 0          # resumes: 2 more trials only
    new_best = studies.choice(load(parts)).label != best_of_3           # then its confirmation and margin runs
    assert len(log.read_text().splitlines()) == len(first) + 2 + (2 if new_best else 0)
    assert trial_values(parts) == trial_values(whole)               # as if never interrupted
    assert studies.choice(load(parts)) == studies.choice(load(whole))
    *values, defaults = trial_values(whole)
    assert len(values) == 5 and len({v["optim.lr"] for v, _ in values}) == 5
    assert defaults == pytest.approx(1.0 - abs(math.log(0.3 / 0.1)) / 10 - 0.01)   # lr 0.3: the config's
    best_values, best = max(values, key=lambda x: x[1])
    assert best == pytest.approx((1.0 - abs(math.log(best_values["optim.lr"] / 0.1)) / 10) - 0.01)  # last 3 evals
    chosen, score = (best_values, best) if best >= defaults else ({"optim.lr": 0.3}, defaults)
    text = (whole / "presets" / "digits_fedavg.yaml").read_text()
    for needle in ("# @package _global_", "# search space: optim.lr log-uniform [0.06, 2.4]",
                   "# trials: 5 sampled", "# made by:", "# command: python -m fedfew.tune",
                   f"# best validation score: {score:.4f}", f"the config defaults scored {defaults:.4f}",
                   "partition.val_fraction=0.2", "never read", "# tuned for: digits, dirichlet (alpha=0.5), M=4 clients, 3 rounds"):
        assert needle in text
    assert presets.preset_overrides(whole / "presets" / "digits_fedavg.yaml") == [f"optim.lr={chosen['optim.lr']}"]
    edges = preset_files.range_edges([search_space.Dimension("optim.lr", 0.06, 2.4, log=True)], chosen)
    assert ("# at a range edge, the range may bind: " in text) == bool(edges)    # said exactly when it is so
    # another thread count or logger is the same study (JOBS=1 after JOBS=2): resumed, nothing rerun
    before = len(log.read_text().splitlines())
    assert tune.main([*argv(whole, 5), "trainer.threads=2"], command=command) == 0
    assert len(log.read_text().splitlines()) == before
    # the same command again: the finished preset keeps the command and date that chose it
    assert tune.main(argv(whole, 5), command=command) == 0
    preset = whole / "presets" / "digits_fedavg.yaml"
    made_then = preset.read_text().replace("# made by: ", "# made by: the first invocation, ")
    preset.write_text(made_then)
    monkeypatch.setenv("FEDFEW_TUNE_MADE_BY", "a later invocation")
    assert tune.main(argv(whole, 5), command=command) == 0
    assert preset.read_text() == made_then
    preset.write_text(made_then.replace("# trials: 5 sampled", "# trials: 4 sampled"))
    assert tune.main(argv(whole, 5), command=command) == 0
    assert "a later invocation" in preset.read_text() and "# trials: 5 sampled" in preset.read_text()  # other content: rewritten
    monkeypatch.delenv("FEDFEW_TUNE_MADE_BY")
    study = load(whole)  # tune.md still sums the trials of the earlier invocation that ran them
    summed = sum(t.user_attrs["wall_s"] for t in studies.completed(study)) + study.user_attrs["defaults"]["wall_s"]
    assert summed > 0 and f"summed over every invocation: {summed / 60:.1f} min (1 at a time)" in (whole / "tune.md").read_text()
    # that last invocation trained nothing, and tune.md says so rather than "0.0 min"
    assert "this invocation trained nothing" in (whole / "tune.md").read_text()
    assert "total wall time of this invocation" not in (whole / "tune.md").read_text()
    # the same folder with other settings is refused, not mixed
    with pytest.raises(TuneError, match="other settings"):
        tune.main(argv(whole, 5, "--val-fraction", "0.3"), command=command)
    # --install auto with setup-changing overrides: conf/tuned/<dataset><setup>/, matched by that setup only
    monkeypatch.setattr(presets, "TUNED_DIR", tmp_path / "tuned")
    installing = argv(whole, 5)
    installing[installing.index("--install") + 1] = "auto"
    assert tune.main(installing, command=command) == 0 and len(log.read_text().splitlines()) == before
    installed = tmp_path / "tuned" / "digits_partition-dirichlet_num_clients-4_rounds-3" / "digits_fedavg.yaml"
    assert installed.read_text() == (whole / "presets" / "digits_fedavg.yaml").read_text()
    assert not (tmp_path / "tuned" / "digits_fedavg.yaml").exists()      # the dataset's own preset is left alone
    runs = compose_config("dataset=digits", "algorithm=fedavg", "partition=dirichlet", "num_clients=4", "rounds=3")
    assert presets.preset_matches(installed, runs)
    assert not presets.preset_matches(installed, compose_config("dataset=digits", "algorithm=fedavg", "partition=dirichlet"))
    assert comparison.preset_for("digits", "fedavg", None, [], runs)[1] == str(installed)


def test_a_tune_resumes_from_another_data_folder_with_the_same_data_only(tmp_path, fake):
    """A study records the fingerprint of its data, not the folder: the same tune with data_dir=B, a
    copy of A, resumes it (nothing runs again) and one with data_dir=C, where a label differs, is
    refused naming both fingerprints; a study made before the fingerprint was recorded is checked by
    a finished run's partition hash (and resumes without the settings added since that shape only the
    runs after the search). The preset header names the data folder <data_dir>."""
    import shutil

    import optuna

    from fedfew.data import fingerprint
    from fedfew.data.datasets import agnews
    from test_compare import write_agnews

    command, log = fake
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write_agnews(a)
    shutil.copytree(a, b)
    write_agnews(c, relabel=True)
    out = tmp_path / "out"

    def args(data):
        return ["--dataset", "agnews", "--algorithms", "fedavg", "--trials", "2", "--out", str(out), "--install", "no",
                "--", f"data_dir={data}", "num_clients=2", "rounds=3"]

    def study():
        return optuna.load_study(study_name="agnews_fedavg", storage=f"sqlite:///{out / 'fedavg' / 'study.db'}")

    ours, theirs = (fingerprint.data_fingerprint(agnews.load(None, d)) for d in (a, c))
    assert tune.main(args(a), command=command) == 0
    assert study().user_attrs["data_fingerprint"] == ours != theirs
    assert study().user_attrs["settings"]["extra"] == ["data_dir=<data_dir>", "num_clients=2", "rounds=3"]
    before = log.read_text().splitlines()
    assert any(line.endswith("defaults/seed0") for line in before)   # the trials ran, and the config defaults
    assert tune.main(args(b), command=command) == 0              # a copy elsewhere: the same study, nothing rerun
    assert log.read_text().splitlines() == before
    text = (out / "presets" / "agnews_fedavg.yaml").read_text()
    assert "# extra overrides: data_dir=<data_dir> num_clients=2 rounds=3\n" in text
    assert "--install no -- 'data_dir=<data_dir>' num_clients=2 rounds=3\n" in text
    assert str(a) not in text and str(b) not in text
    with pytest.raises(TuneError, match=rf"holds a tune of fedavg made from other data \(data fingerprint "
                                        rf"{ours[:12]} recorded, {theirs[:12]} in {c}\)"):
        tune.main(args(c), command=command)

    # a study made before studies recorded their data (and the settings of the runs after the search):
    # one of its finished runs' partition hash decides
    study().set_user_attr("data_fingerprint", None)
    settings = study().user_attrs["settings"]
    study().set_user_attr("settings", {**{k: v for k, v in settings.items() if k not in ("confirm_seeds", "stability")},
                                       "extra": [f"data_dir={a}", "num_clients=2", "rounds=3"]})  # and its folder
    config = OmegaConf.to_container(compose_config("dataset=agnews", "algorithm=fedavg", f"data_dir={a}",
                                                   "num_clients=2", "rounds=3", "partition.val_fraction=0.2"), resolve=True)
    run = out / "fedavg" / "trial000" / "seed0" / "results.json"
    run.write_text(json.dumps({**json.loads(run.read_text()), "config": config,
                               "partition_hash": fingerprint.DataCheck(a).partition_hash(config)}))
    assert tune.main(args(b), command=command) == 0 and log.read_text().splitlines() == before
    assert study().user_attrs["settings"]["extra"] == ["data_dir=<data_dir>", "num_clients=2", "rounds=3"]  # made portable
    with pytest.raises(TuneError, match=r"made from other data \(partition hash [0-9a-f]{12} recorded \(no data "
                                        r"fingerprint"):
        tune.main(args(c), command=command)


def test_an_interrupted_trial_runs_again_with_its_values_and_a_failed_one_stops_the_tune(tmp_path, fake, monkeypatch):
    command, log = fake
    out = tmp_path / "out"
    assert tune.main(argv(out, 2), command=command) == 0
    stale = left_running(out)
    lost = stale.params["optim.lr"]
    (out / "fedavg" / f"trial{stale.number:03d}").mkdir()
    assert tune.main(argv(out, 3), command=command) == 0
    redone = trial_values(out)[-2][0]["optim.lr"]
    assert redone == float(f"{lost:.3g}") and not (out / "fedavg" / f"trial{stale.number:03d}").exists()
    monkeypatch.setenv("FAKE_FAIL_ABOVE", "0.0")
    with pytest.raises(TuneError, match="(?s)failed; log .*diverged on purpose"):
        tune.main(argv(out, 4), command=command)
    assert len(trial_values(out)) == 3 + 1                           # the finished trials are kept


def test_an_interrupted_trial_reuses_its_finished_runs_and_continues_its_checkpoints(tmp_path, fake):
    """A killed tune's trial folder is taken over by the trial that repeats it, and its seed's
    checkpoint is resumed from (results reused and stale folders restarted: the same
    fedfew.experiments.launch.progress as make compare's, tests/test_compare.py)."""
    import optuna

    command, log = fake
    out = tmp_path / "out"
    assert tune.main(argv(out, 1, "--seeds", "0"), command=command) == 0
    lost = left_running(out)
    folder = out / "fedavg" / f"trial{lost.number:03d}"
    (folder / "seed0" / "checkpoints").mkdir(parents=True)      # seed 0 was at a checkpoint
    (folder / "seed0" / "checkpoints" / "last.ckpt").write_bytes(b"stand-in")
    before = len(log.read_text().splitlines())
    assert tune.main(argv(out, 2, "--seeds", "0"), command=command) == 0
    new = log.read_text().splitlines()[before:]
    repeat = max(t.number for t in load(out).get_trials(states=(optuna.trial.TrialState.COMPLETE,)))
    moved = out / "fedavg" / f"trial{repeat:03d}"
    assert not folder.exists() and moved.is_dir()
    assert new[0] == f"{moved / 'seed0'} resume={moved / 'seed0' / 'checkpoints' / 'last.ckpt'}"  # resumed
    assert all("_lr1.5x/seed0" in line for line in new[1:])  # then only a margin run, if the best changed


def test_a_trial_stopped_by_a_signal_stays_running_and_continues_on_the_next_invocation(tmp_path, fake, monkeypatch):
    """A run that exits after saving a checkpoint on Ctrl-C/SIGTERM (128 + signum) is not a failed
    trial: the tune stops with 'interrupted', the other algorithm still finishes, and the next
    invocation repeats the trial from its checkpoint."""
    import optuna

    command, log = fake
    out = tmp_path / "out"
    monkeypatch.setenv("FAKE_SIGNAL", "fedavg")
    with pytest.raises(TuneError, match="interrupted .*run the same command again"):
        tune.main(argv(out, 2, algorithms=("fedavg", "local"), jobs=2), command=command)
    running = load(out, "fedavg").get_trials(states=(optuna.trial.TrialState.RUNNING,))
    assert len(running) == 2 and not load(out, "fedavg").get_trials(states=(optuna.trial.TrialState.FAIL,))
    assert (out / "presets" / "digits_local.yaml").is_file() and "not finished: fedavg" in (out / "tune.md").read_text()
    monkeypatch.delenv("FAKE_SIGNAL")
    before = len(log.read_text().splitlines())
    assert tune.main(argv(out, 2, algorithms=("fedavg", "local"), jobs=2), command=command) == 0
    new = log.read_text().splitlines()[before:]
    # the 2 trials continued, then the defaults, then the best confirmed on seed 1 and run at 1.5x its lr
    assert len(new) == 5 and sum(" resume=" in line for line in new) == 2
    assert sum("/seed1" in line for line in new) == 1 and sum("_lr1.5x/seed0" in line for line in new) == 1
    assert len(trial_values(out, "fedavg")) == 2 + 1


def test_a_tune_resumed_with_more_jobs_never_runs_the_same_values_twice(tmp_path, fake, monkeypatch):
    """Interrupted at --jobs 1 and resumed at --jobs 2, the batch holds the repeat of the interrupted
    trial beside a new one; the new one must not replay the repeat's draw (it did: the CIFAR-10 tune
    of 2026-12-06 queued each method's first values twice)."""
    command, log = fake
    out = tmp_path / "out"
    monkeypatch.setenv("FAKE_SIGNAL", "fedavg")
    with pytest.raises(TuneError, match="interrupted"):
        tune.main(argv(out, 2, "--seeds", "0", jobs=1), command=command)
    monkeypatch.delenv("FAKE_SIGNAL")
    assert tune.main(argv(out, 2, "--seeds", "0", jobs=2), command=command) == 0
    lrs = [values["optim.lr"] for values, _ in trial_values(out)[:-1]]
    assert len(lrs) == 2 and lrs[0] != lrs[1]
    trial_runs = [line.split()[0] for line in log.read_text().splitlines() if "/trial" in line and "_lr1.5x" not in line]
    assert len(trial_runs) == 3  # the interrupted run, its repeat (continued), the new trial: nothing else


def test_a_refused_checkpoint_starts_the_trial_afresh(tmp_path, fake, monkeypatch):
    command, log = fake
    out = tmp_path / "out"
    assert tune.main(argv(out, 1), command=command) == 0
    lost = left_running(out)
    (out / "fedavg" / f"trial{lost.number:03d}" / "seed0" / "checkpoints").mkdir(parents=True)
    (out / "fedavg" / f"trial{lost.number:03d}" / "seed0" / "checkpoints" / "last.ckpt").write_text("stand-in")
    monkeypatch.setenv("FAKE_REFUSE", "1")
    before = len(log.read_text().splitlines())
    assert tune.main(argv(out, 2), command=command) == 0
    new = log.read_text().splitlines()[before:]
    assert " resume=" in new[0] and " resume=" not in new[1]   # refused, then afresh
    assert len(new) in (2, 4)  # and, if it is the new best, its confirmation and margin runs
    assert len(trial_values(out)) == 2 + 1


def test_parallel_trials_finish_the_same_budget(tmp_path, fake, monkeypatch):
    """Studies share the workers (Slots) without changing what each chooses; a failing method
    does not stop the others, whose presets are written."""
    command, _ = fake
    out, alone = tmp_path / "out", tmp_path / "alone"
    assert tune.main(argv(out, 4, algorithms=("fedavg", "local"), jobs=2), command=command) == 0
    assert len(trial_values(out, "fedavg")) == len(trial_values(out, "local")) == 4 + 1
    assert "| fedavg |" in (out / "tune.md").read_text() and "| local |" in (out / "tune.md").read_text()
    assert tune.main(argv(alone, 4, algorithms=("local",), jobs=2), command=command) == 0
    assert trial_values(alone, "local") == trial_values(out, "local")      # packing changes no value
    monkeypatch.setenv("FAKE_FAIL", "fedavg")
    failing = tmp_path / "failing"
    with pytest.raises(TuneError, match="(?s)fedavg trial.*diverged on purpose.*other algorithms are written"):
        tune.main(argv(failing, 2, algorithms=("fedavg", "local"), jobs=2), command=command)
    assert (failing / "presets" / "digits_local.yaml").is_file()
    assert not (failing / "presets" / "digits_fedavg.yaml").exists()
    assert "| local |" in (failing / "tune.md").read_text()


def test_a_study_resumed_at_its_confirmation_lets_the_next_algorithm_start(tmp_path, fake, monkeypatch):
    """A study whose trials are all finished queues no batch: it must still signal the next
    algorithm's study to start (else a worker idles through the confirmation runs)."""
    import threading

    command, _ = fake
    out = tmp_path / "out"
    assert tune.main(argv(out, 1), command=command) == 0
    queued, seen = threading.Event(), []

    def confirmation_run(*args):  # every run of the resumed study is a confirmation or margin run
        seen.append(queued.wait(10))
        return 0.5, 1.0, 1.0

    monkeypatch.setattr(studies, "run_trial", confirmation_run)
    plan, = tuning.plans(tune.parse_args(argv(out, 1)))
    studies.tune_algorithm(plan, command, lambda line: None, studies.Slots(2), 0, queued)
    assert seen == [True, True]   # the margin and the seed-1 confirmation, each after the signal


def test_a_free_worker_takes_the_earliest_listed_algorithms_run_and_stop_starts_nothing():
    import threading

    slots = studies.Slots(2)
    started, gates = [], {name: threading.Event() for name in ("x", "y", "a", "b", "c")}
    lock = threading.Condition()

    def job(name):
        with lock:
            started.append(name)
            lock.notify_all()
        assert gates[name].wait(10)
        return name

    def wait_for(n):
        with lock:
            assert lock.wait_for(lambda: len(started) >= n, timeout=10)

    busy = [slots.submit(5, job, "x"), slots.submit(5, job, "y")]   # both workers taken
    wait_for(2)
    queued = {name: slots.submit(prio, job, name) for name, prio in (("c", 2), ("b", 1), ("a", 0))}
    gates["x"].set()                                                   # one worker frees up ...
    wait_for(3)
    assert started[2] == "a"                                           # ... and takes priority 0
    slots.stop()                                                       # b and c never start ...
    assert queued["b"].cancelled() and queued["c"].cancelled()
    assert slots.submit(0, job, "d").cancelled()                       # ... nor anything submitted later
    gates["y"].set()
    gates["a"].set()
    slots.close()
    assert started == ["x", "y", "a"] and [f.result() for f in busy] == ["x", "y"] and queued["a"].result() == "a"


def test_installed_presets_apply_and_record_their_provenance():
    """Every preset in conf/tuned (and in its setup folders) records how it was made, applies its values,
    and was tuned for the setup it is installed for: the dataset's default one at the top, the setup of
    its extra overrides in conf/tuned/<dataset><setup>/ (selected with tuned=<folder>/<name>)."""
    installed = sorted(presets.TUNED_DIR.glob("*.yaml")) + sorted(presets.TUNED_DIR.glob("*/*.yaml"))
    assert installed, "conf/tuned holds the presets of make tune"
    for path in installed:
        text = path.read_text()
        for needle in ("# search space:", "# trials:", "# made by:", "# command:", "# best validation score:",
                       "# tuned for:"):
            assert needle in text, f"{path.name} lacks {needle!r}"
        dataset, algorithm = path.stem.split("_", 1)
        setup = presets.setup_changing(presets.preset_header(path)["extra overrides"].replace("(none)", "").split())
        folder = path.parent.relative_to(presets.TUNED_DIR)
        assert folder == tuning.setup_presets_dir(dataset, setup).relative_to(presets.TUNED_DIR), path
        choice = [] if folder == Path(".") else [f"tuned={folder}/{path.stem}"]
        cfg = compose_config(f"dataset={dataset}", f"algorithm={algorithm}", *setup, *choice, tuned=True)
        plain = compose_config(f"dataset={dataset}", f"algorithm={algorithm}", *setup, "~tuned")
        assert presets.preset_matches(path, plain), f"{path} is not tuned for the setup it is installed for"
        for override in presets.preset_overrides(path):               # optim.lr included: the preset comes after _self_
            key, value = override.split("=", 1)
            assert _same(OmegaConf.select(cfg, key), value), f"{path.name}: {key} is not {value}"
        if "optim.lr" in dict(o.split("=", 1) for o in presets.preset_overrides(path)):
            assert plain.optim.lr == plain.dataset.lr                # ~tuned: the config without the preset


def _same(configured, text: str) -> bool:
    if isinstance(configured, (int, float)) and not isinstance(configured, bool):
        return float(configured) == float(text)
    return str(configured).lower() == text.lower()


SHUFFLE_TEST_LABELS = '''
import sys
import numpy as np
import torch
import fedfew.data.federated as federated

build = federated.build_federated_data

def shuffled(cfg, *args, **kwargs):
    data = build(cfg, *args, **kwargs)
    test = torch.as_tensor(np.concatenate([c.test for c in data.clients]))
    perm = torch.randperm(len(test), generator=torch.Generator().manual_seed(7))
    data.targets[test] = data.targets[test][perm]
    return data

federated.build_federated_data = shuffled
import runpy
sys.argv = ["fedfew.train", *sys.argv[1:]]
runpy.run_module("fedfew.train", run_name="__main__", alter_sys=True)  # as python -m fedfew.train
'''


@pytest.mark.slow
def test_tuning_never_reads_the_test_labels(tmp_path):
    """A tune whose runs see shuffled test labels chooses exactly the same values (and scores)."""
    wrapper = tmp_path / "shuffled_train.py"
    wrapper.write_text(SHUFFLE_TEST_LABELS)
    plain, shuffled = [sys.executable, "-m", "fedfew.train"], [sys.executable, str(wrapper)]
    extra = ["--", "partition=dirichlet", "num_clients=4", "rounds=2", "eval_every=1", "trainer.threads=1"]

    def start(out, command, trials):
        args = ["--dataset", "digits", "--algorithms", "fedfew", "--trials", str(trials), "--out", str(out),
                "--install", "no", "--startup", "1", "--seeds", "0", *extra]  # trial 2: TPE, chosen from trial 1's score
        # (one tuning seed: confirmation is checked in test_the_best_candidate_is_confirmed_on_a_second_seed...)
        # each tune in its own process, the two at once (their runs use one thread each)
        code = f"import sys; from fedfew import tune; sys.exit(tune.main(sys.argv[1:], command={command!r}))"
        return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "WANDB_MODE": "disabled"})

    # (resuming is checked in test_study_is_reproducible_resumes_and_writes_a_preset)
    tunes = [start(tmp_path / "plain", plain, 2), start(tmp_path / "shuffled", shuffled, 2)]
    for proc in tunes:
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-3000:]
    assert trial_values(tmp_path / "plain", "fedfew") == trial_values(tmp_path / "shuffled", "fedfew")
    body = [(tmp_path / d / "presets" / "digits_fedfew.yaml").read_text().split("# command:")[1].splitlines()[1:]
            for d in ("plain", "shuffled")]
    assert body[0] == body[1] and any(line.startswith("optim:") for line in body[0])
    # the check can fail: scored on test, the same run sees the shuffled labels
    procs = {name: subprocess.Popen([*command, "partition=dirichlet", "num_clients=4", "rounds=2", "logger=none",
                                     "trainer.threads=1", f"hydra.run.dir={tmp_path / name}"], cwd=ROOT,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env={**os.environ, "WANDB_MODE": "disabled"})
             for command, name in ((plain, "a"), (shuffled, "b"))}  # the two at once: one thread each
    assert all(p.wait(timeout=300) == 0 for p in procs.values())
    accs = [json.loads((tmp_path / name / "results.json").read_text())["summary"]["acc_mean"] for name in procs]
    assert accs[0] != accs[1]


def test_a_chosen_value_at_a_range_edge_is_reported():
    lr = search_space.Dimension("optim.lr", 0.06, 2.4, log=True)
    epochs = search_space.Dimension("algorithm.head_epochs", 1, 10, kind="int")
    alpha = search_space.Dimension("algorithm.alpha", 0.1, 0.9)
    pick = search_space.Dimension("model.name", kind="categorical", choices=("mlp", "cnn"))
    assert lr.position(0.3) == pytest.approx(math.log(5) / math.log(40))          # log scale: 0.44
    assert alpha.position(0.12) == pytest.approx(0.025) and epochs.position(10) == 1.0
    space = [lr, epochs, alpha, pick]
    assert preset_files.range_edges(space, {"optim.lr": 0.3, "algorithm.head_epochs": 5, "algorithm.alpha": 0.5,
                                    "model.name": "cnn"}) == []
    assert preset_files.range_edges(space, {"optim.lr": 2.2, "algorithm.head_epochs": 1, "algorithm.alpha": 0.12}) == [
        "optim.lr=2.2 (top tenth of [0.06, 2.4], log scale)",                    # ln(2.2/0.06)/ln(40) = 0.98
        "algorithm.head_epochs=1 (bottom tenth of [1, 10])",
        "algorithm.alpha=0.12 (bottom tenth of [0.1, 0.9])"]
    assert preset_files.range_edges([lr], {"optim.lr": 3.0}) == ["optim.lr=3.0 (outside [0.06, 2.4])"]  # a config default
    assert preset_files.range_edges([lr], {}) == []                                      # a key the preset does not set
    # config defaults that are no number in the range: apfl's alpha_lr: null (= optim.lr), fedprox's mu_prox: 0
    assert preset_files.range_edges([search_space.Dimension("algorithm.alpha_lr", 0.01, 1.0, log=True)], {"algorithm.alpha_lr": None}) == []
    assert preset_files.range_edges([search_space.Dimension("algorithm.mu_prox", 0.001, 1.0, log=True)], {"algorithm.mu_prox": 0}) == [
        "algorithm.mu_prox=0 (outside [0.001, 1])"]


@pytest.mark.parametrize("stop", [False, True])
def test_a_diverged_trial_is_a_failed_trial_and_never_chosen(tmp_path, fake, monkeypatch, stop):
    """Every lr above 0.2 makes a local copy non-finite (or the whole run stop early, exit 3) while
    scoring 0.99, better than any finite trial: those trials fail, count in the budget, and a
    lower lr is chosen; the preset names them."""
    command, log = fake
    monkeypatch.setenv("FAKE_NAN_ABOVE", "0.2")
    if stop:
        monkeypatch.setenv("FAKE_STOP", "1")
    out = tmp_path / "out"
    assert tune.main(argv(out, 6), command=command) == 0
    from optuna.trial import TrialState

    trials = load(out).get_trials()
    diverged = [t for t in trials if t.user_attrs.get("diverged")]
    lrs = {t.user_attrs["values"]["optim.lr"] for t in diverged}
    assert diverged and all(t.state == TrialState.FAIL for t in diverged) and min(lrs) > 0.2
    assert len(studies.finished(load(out))) == 6                                     # the budget: 6 trials in all
    assert load(out).user_attrs["defaults"]["value"] is None                      # lr 0.3 diverged too
    chosen = studies.choice(load(out))
    assert chosen.values["optim.lr"] <= 0.2 and chosen.value < 0.99
    assert set(chosen.confirmed) == {"1"} and (chosen.margin["diverged"] is not None) == (chosen.margin["lr"] > 0.2)
    text = (out / "presets" / "digits_fedavg.yaml").read_text()
    assert f"# diverged: trial {diverged[0].number} (optim.lr=" in text and "the config defaults (seed 0:" in text
    assert "| fedavg |" in (out / "tune.md").read_text()


def test_the_best_candidate_is_confirmed_on_a_second_seed_and_its_margin_reported(tmp_path, fake, monkeypatch):
    """Above lr 0.2 runs diverge on seed 1 only: the trials (seed 0) rank such an lr first, its
    confirmation on seed 1 rejects it and the next finite candidate is chosen; the preset records
    both seeds' scores and whether 1.5x the chosen lr diverged."""
    command, log = fake
    monkeypatch.setenv("FAKE_NAN_ABOVE", "0.2")
    monkeypatch.setenv("FAKE_NAN_SEED", "1")
    out = tmp_path / "out"
    assert tune.main(argv(out, 6), command=command) == 0
    ranked = studies.ranked_candidates(load(out))
    assert ranked[0][2] == 0.99 - 0.01  # a diverging lr ranks first on seed 0, which cannot see it
    chosen = studies.choice(load(out))
    lr = chosen.values["optim.lr"]
    assert lr <= 0.2 and chosen.rejected                                          # the first candidates diverged on seed 1
    assert set(chosen.confirmed) == {"1"}
    expected = 1.0 - abs(math.log(lr / 0.1)) / 10 - 0.01                          # the fake's score, last 3 evaluations
    assert chosen.value == pytest.approx(expected) and chosen.confirmed["1"] == pytest.approx(expected)
    margin_lr = float(f"{lr * 1.5:.3g}")
    assert chosen.margin["lr"] == margin_lr and chosen.margin["diverged"] is None  # seed 0 stays finite
    text = (out / "presets" / "digits_fedavg.yaml").read_text()
    assert f"# confirmed: seed 1: {expected:.4f}" in text and "rejected first, diverged on a confirmation seed" in text
    assert f"# stability margin: at 1.5x the chosen lr (optim.lr={margin_lr}), seed 0: " in text


def test_tune_md_names_no_data_folder(tmp_path, fake):
    """tune.md, like the presets, records the command with data_dir=<data_dir> (committed tunes name no machine's path)."""
    command, _ = fake
    out = tmp_path / "out"
    assert tune.main([*argv(out, 1), f"data_dir={tmp_path / 'where'}"], command=command) == 0
    text = (out / "tune.md").read_text()
    assert "data_dir=<data_dir>" in text and str(tmp_path / "where") not in text


def test_bad_seeds_and_stability_are_refused_before_any_run(tmp_path, fake):
    command, log = fake
    for more, words in [(["--seeds"], "give one or more distinct seeds"), (["--seeds", "0", "0"], "distinct seeds"),
                        (["--stability", "1"], "a number > 1")]:
        with pytest.raises(TuneError, match=words):
            tune.main(argv(tmp_path / "out", 2, *more), command=command)
    assert not log.exists()
