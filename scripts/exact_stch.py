#!/usr/bin/env python3
"""Exact, centralised STCH-Set gradient descent: what the objective itself prefers, without any
federated update rule (docs/fedfew.md, "When fewer models in use is the right answer").

K models are trained jointly by full-batch gradient descent on g(Theta) (``stch_value`` of the
M x K matrix of every client's mean train loss under every model, with the run's sample
weighting), on the same partition a ``fedfew.train`` run would use. It prints, every so often, the
clients per model (argmin_k L_ik on the train split) and at the end the client-mean test accuracy
of each client's best model. Run with the project's venv:

    .venv/bin/python scripts/exact_stch.py partition=dirichlet
    .venv/bin/python scripts/exact_stch.py partition=pathological steps=3000

Any ``fedfew.train`` override is accepted (dataset, num_clients, algorithm.K, algorithm.mu,
seed, ...); ``steps=`` and ``lr=`` set the gradient descent (defaults 2000 and 0.5).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    steps = int(next((a.split("=", 1)[1] for a in argv if a.startswith("steps=")), 2000))
    lr = float(next((a.split("=", 1)[1] for a in argv if a.startswith("lr=")), 0.5))
    overrides = [a for a in argv if not a.startswith(("steps=", "lr="))]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    from fedfew.data.federated import build_federated_data
    from fedfew.models import MODELS
    from fedfew.core.model_set import KModelSet
    from fedfew.stch.scalarization import stch_value, weight_losses
    from fedfew.core.seeding import derive_seed
    from fedfew.simulator.simulation import data_info

    torch.set_num_threads(1)
    data = build_federated_data(cfg)
    K, mu = int(cfg.algorithm.K), float(cfg.algorithm.mu)
    module = KModelSet(lambda: MODELS.get(cfg.model.name)(cfg.model, data_info(data)), K=K,
                       seed=derive_seed(cfg.seed, "model"))
    models = list(module.models)
    params = [p for m in models for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=lr)
    train = [torch.as_tensor(c.train) for c in data.clients]
    test = [torch.as_tensor(c.test) for c in data.clients]
    sizes = torch.tensor([len(t) for t in train])

    def loss_matrix(index_sets) -> torch.Tensor:
        rows = []
        for idx in index_sets:
            x, y = data.batch(idx)
            rows.append(torch.stack([F.cross_entropy(m(x), y) for m in models]))
        return torch.stack(rows)  # (M, K)

    print(f"exact STCH-Set GD: {cfg.dataset.name}, partition={cfg.partition.name}, M={len(train)}, K={K}, "
          f"mu={mu} ({cfg.algorithm.get('mu_scale', 'relative')}), {steps} steps of full-batch GD, lr {lr}")
    for step in range(1, steps + 1):
        L = loss_matrix(train)
        scaled = weight_losses(L, sizes, str(cfg.algorithm.sample_weighting), str(cfg.algorithm.get("mu_scale", "relative")))
        g = stch_value(scaled, mu)
        optimizer.zero_grad()
        g.backward()
        optimizer.step()
        if step % max(1, steps // 10) == 0 or step == steps:
            served = torch.bincount(L.detach().argmin(dim=1), minlength=K).tolist()
            print(f"step {step:5d}  g {float(g):.4f}  mean best loss {float(L.detach().min(dim=1).values.mean()):.4f}  "
                  f"clients per model {served}", flush=True)
    with torch.no_grad():
        best = loss_matrix(train).argmin(dim=1)
        accs = []
        for i, idx in enumerate(test):
            x, y = data.batch(idx)
            accs.append(float((models[int(best[i])](x).argmax(dim=1) == y).float().mean()))
    print(f"final: clients per model {torch.bincount(best, minlength=K).tolist()}, "
          f"client-mean test accuracy {sum(accs) / len(accs):.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
