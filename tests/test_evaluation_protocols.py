"""Evaluation protocols and metrics (issue #16, docs/evaluation.md): balanced accuracy is the
mean recall over the classes present (not torchmetrics' macro accuracy), macro-F1 is
scikit-learn's; ``finetune`` scores fine-tuned copies without changing training;
``reference`` reports the best round and says it is optimistic; ``eval.split=val`` never reads
the test labels."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from sklearn.metrics import balanced_accuracy_score, f1_score

from fedfew.reporting.callbacks import eval_scalars
from fedfew.config.rules import ConfigError, validate_config
from fedfew.data.federated import build_federated_data
from fedfew.simulator.evaluation import EvalSettings, client_metrics
from fedfew.core.local_training import train_local
from fedfew.core.model_set import KModelSet
from fedfew.core.seeding import derive_seed
from fedfew.simulator.simulation import Simulation

from conftest import compose_config


def test_balanced_accuracy_and_macro_f1_by_hand():
    y = torch.tensor([0, 0, 1, 1, 1])
    p = torch.tensor([0, 2, 1, 1, 0])  # class 2 predicted but absent, class 3 absent from both
    correct, balanced, f1 = client_metrics(p, y, num_classes=4)
    assert correct == 3
    assert balanced == pytest.approx((1 / 2 + 2 / 3) / 2)           # recall of the 2 classes present
    # F1: class 0 (P 1/2, R 1/2) 0.5; class 1 (P 1, R 2/3) 0.8; class 2 (predicted only) 0; class 3 left out
    assert f1 == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    # torchmetrics' macro accuracy is not balanced accuracy: it averages in class 2's recall of 0
    from torchmetrics.functional.classification import multiclass_accuracy

    assert float(multiclass_accuracy(p, y, num_classes=4, average="macro")) == pytest.approx((0.5 + 2 / 3 + 0) / 3)


def test_metrics_equal_scikit_learn_on_random_clients():
    rng = np.random.default_rng(0)
    for _ in range(50):
        C = int(rng.integers(2, 8))
        n = int(rng.integers(1, 40))
        present = rng.choice(C, size=int(rng.integers(1, C + 1)), replace=False)
        y = rng.choice(present, size=n)
        p = np.where(rng.random(n) < 0.6, y, rng.integers(0, C, size=n))
        correct, balanced, f1 = client_metrics(torch.as_tensor(p), torch.as_tensor(y), C)
        assert correct == int((p == y).sum())
        with np.errstate(all="ignore"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert balanced == pytest.approx(balanced_accuracy_score(y, p), abs=1e-6)
                assert f1 == pytest.approx(f1_score(y, p, average="macro", zero_division=0), abs=1e-6)


def test_eval_settings_and_their_errors():
    assert EvalSettings.from_config(compose_config()) == EvalSettings("final", 1, "test")
    with pytest.raises(ConfigError, match="eval.protocol='best'"):
        validate_config(compose_config("eval.protocol=best"))
    with pytest.raises(ConfigError, match="partition.val_fraction=0.2"):
        validate_config(compose_config("eval.split=val"))             # no validation split to score on
    with pytest.raises(ConfigError, match="picks the best round on test"):
        validate_config(compose_config("eval.split=val", "partition.val_fraction=0.2", "eval.protocol=reference"))
    with pytest.raises(ConfigError, match="eval.finetune_epochs=0"):
        validate_config(compose_config("eval.finetune_epochs=0"))
    validate_config(compose_config("eval.split=val", "partition.val_fraction=0.2", "eval.protocol=finetune"))
    # eval.also: more protocols at the same evaluations; repeats, unknown ones and reference on val are refused
    assert EvalSettings.from_config(compose_config("eval.also=[finetune]")).protocols == ("final", "finetune")
    validate_config(compose_config("eval.also=[finetune,reference]"))
    with pytest.raises(ConfigError, match=r"eval.also=\['best'\]: allowed list of distinct protocols"):
        validate_config(compose_config("eval.also=[best]"))
    with pytest.raises(ConfigError, match="leave reference out of eval.also when scoring on the validation split"):
        validate_config(compose_config("eval.split=val", "partition.val_fraction=0.2", "eval.also=[reference]"))
    with pytest.raises(ConfigError, match="repeats eval.protocol=finetune"):
        validate_config(compose_config("eval.protocol=finetune", "eval.also=[finetune]"))
    with pytest.raises(ValueError, match="eval.also=\\['finetune', 'finetune'\\]"):
        EvalSettings.from_config(compose_config("eval.also=[finetune,finetune]"))
    validate_config(compose_config("eval.protocol=finetune", "eval.also=[final]"))


def _cfg(*overrides):
    return compose_config("partition=dirichlet", "num_clients=4", "algorithm=fedavg", "rounds=3", "eval_every=1",
                          "dataset.batch_size=32", "logger=none", *overrides)


def _fit(tmp_path, cpu_fabric, name, *overrides, data=None):
    sim = Simulation(_cfg(*overrides), cpu_fabric, tmp_path / name, data=data)
    return sim, sim.fit()


@pytest.mark.slow
def test_finetune_scores_finetuned_copies_and_leaves_training_alone(tmp_path, cpu_fabric):
    final_sim, final = _fit(tmp_path, cpu_fabric, "final")
    tuned_sim, tuned = _fit(tmp_path, cpu_fabric, "finetune", "eval.protocol=finetune", "eval.finetune_epochs=2")
    # the same training: losses of every round and the final server model
    assert [h["loss"].tolist() for h in final_sim.history] == [h["loss"].tolist() for h in tuned_sim.history]
    for a, b in zip(final_sim.module.models[0].parameters(), tuned_sim.module.models[0].parameters()):
        assert torch.equal(a, b)
    assert tuned["summary"]["protocol"] == "finetune" and tuned["summary"]["optimistic"] is False
    # each client's score, by hand: the server model copied, 2 local epochs on its train split, test accuracy
    sim = tuned_sim
    for client, row in zip(sim.host_data.clients, tuned["clients"]):
        copy_set = KModelSet(lambda: copy.deepcopy(sim.module.models[0]), K=1, lr=float(sim.cfg.optim.lr))
        copy_set.working.load_state_dict(sim.module.models[0].state_dict())
        index = torch.as_tensor(client.train)
        train_local(copy_set, sim.data, index, 2, 32, derive_seed(0, "finetune", 3, client.id))
        test = torch.as_tensor(client.test)
        with torch.no_grad():
            copy_set.working.eval()
            pred = copy_set.working(sim.data.inputs[test]).argmax(1)
        assert row["acc"] == pytest.approx(float((pred == sim.data.targets[test]).float().mean()))
    assert tuned["summary"]["acc_mean"] != final["summary"]["acc_mean"]

    # eval.also=[finetune]: one run reports both, each figure equal to the run of that protocol
    both_sim, both = _fit(tmp_path, cpu_fabric, "both", "eval.also=[finetune]", "eval.finetune_epochs=2")
    assert [h["loss"].tolist() for h in both_sim.history] == [h["loss"].tolist() for h in final_sim.history]
    assert both["summary"] == final["summary"] and both["clients"] == final["clients"]
    assert [{k: v for k, v in e.items() if k != "also"} for e in both["evaluations"]] == final["evaluations"]
    also = both["also"]["finetune"]
    assert also["summary"] == tuned["summary"] and also["clients"] == tuned["clients"]
    assert also["evaluations"] == tuned["evaluations"] and len(also["evaluations"]) == 3
    # metrics.csv and the loggers get the extra protocol's accuracies beside the run's own
    scalars = eval_scalars(both)
    assert scalars["acc_mean"] == final["summary"]["acc_mean"]
    assert [scalars[f"finetune_{k}"] for k in ("acc_mean", "acc_weighted", "acc_min")] == [
        tuned["summary"][k] for k in ("acc_mean", "acc_weighted", "acc_min")]


@pytest.mark.slow
def test_reference_reports_the_best_round_and_says_it_is_optimistic(tmp_path, cpu_fabric):
    _, res = _fit(tmp_path, cpu_fabric, "reference", "eval.protocol=reference", "optim.lr=0.9")
    accs = {e["round"]: e["acc_mean"] for e in res["evaluations"]}
    best = max(accs, key=lambda r: (accs[r], -r))
    s = res["summary"]
    assert s["optimistic"] is True and s["protocol"] == "reference"
    assert s["best_round"] == best and s["acc_mean"] == pytest.approx(accs[best])
    assert s["final_round_acc_mean"] == pytest.approx(accs[3])
    # the same figures from a final-protocol run that scores reference (and finetune) at its evaluations too
    both_sim, both = _fit(tmp_path, cpu_fabric, "also", "eval.also=[finetune,reference]", "optim.lr=0.9")
    also = both["also"]["reference"]
    assert also["summary"] == s and also["clients"] == res["clients"] and also["evaluations"] == res["evaluations"]
    assert both["also"]["finetune"]["summary"]["acc_mean"] == pytest.approx(accs[3])   # finetune: the final round
    assert both["summary"]["protocol"] == "final" and both["summary"]["optimistic"] is False
    # the best round so far travels in checkpoints, so a resumed run reports the same
    assert both_sim.best_also["reference"]["round"] == best
    resumed = Simulation(_cfg("eval.also=[finetune,reference]", "optim.lr=0.9"), cpu_fabric, tmp_path / "resumed")
    resumed.load_state_dict(both_sim.state_dict(3))
    assert resumed.best_also == both_sim.best_also


@pytest.mark.slow
def test_scoring_on_validation_never_reads_the_test_labels(tmp_path, cpu_fabric):
    cfg = _cfg("partition.val_fraction=0.2")
    clean = build_federated_data(cfg)
    shuffled = build_federated_data(cfg)
    test = torch.as_tensor(np.concatenate([c.test for c in shuffled.clients]))
    gen = torch.Generator().manual_seed(1)
    shuffled.targets[test] = shuffled.targets[test][torch.randperm(len(test), generator=gen)]
    assert not torch.equal(clean.targets, shuffled.targets)
    runs = {}
    for name, data in (("clean", clean), ("shuffled", shuffled)):
        for split in ("val", "test"):
            _, runs[name, split] = _fit(tmp_path, cpu_fabric, f"{name}_{split}", "partition.val_fraction=0.2",
                                        f"eval.split={split}", data=data)
    val = runs["clean", "val"]
    assert val["summary"]["eval_split"] == "val"
    assert [c["n_test"] for c in val["clients"]] == [len(c.val) for c in clean.clients]  # scored on val
    assert [c["acc"] for c in val["clients"]] == [c["acc"] for c in runs["shuffled", "val"]["clients"]]
    assert val["evaluations"] == runs["shuffled", "val"]["evaluations"]
    # the check can fail: scored on test, the shuffled labels change the accuracy
    assert runs["clean", "test"]["summary"]["acc_mean"] != runs["shuffled", "test"]["summary"]["acc_mean"]
