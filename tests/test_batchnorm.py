"""BatchNorm policy (docs/models.md): a model's state vector (parameters, then BatchNorm running
statistics and counters) is what is averaged, so the server's statistics are the clients'
statistics weighted like the parameters (FedAvg: n_i; FedFew: alpha_i w_ik, both engines);
FedBN keeps each client's BatchNorm layers local, across rounds and checkpoints; a final
one-sample batch is merged into the previous batch; ResNet-18 (torchvision, no download) is a
BodyHead that FedRep trains; its configs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms.fedbn import local_tensors
from fedfew.core.checkpoint import load_checkpoint, save_checkpoint
from fedfew.config.rules import ConfigError, validate_config
from fedfew.data.base import ClientSplit, FederatedData
from fedfew.core.local_training import batch_bounds, train_local
from fedfew.models import MODELS, DataInfo
from fedfew.core.model_set import assign_state_, assign_tensors_, flat_state, flatten_tensors, named_state
from fedfew.core.seeding import derive_seed
from fedfew.simulator.simulation import Simulation

from conftest import compose_config

BATCH, EPOCHS = 32, 1


def bn_sim(run_dir, fabric, algorithm: str, *overrides: str, data: FederatedData | None = None) -> Simulation:
    """Digits (Dirichlet, 3 clients), the MLP with a BatchNorm1d after its hidden layer."""
    cfg = compose_config("num_clients=3", f"algorithm={algorithm}", "rounds=2", f"local_epochs={EPOCHS}",
                         f"dataset.batch_size={BATCH}", "optim.lr=0.1", "model.norm=batch", "model.hidden=[16]",
                         "partition=dirichlet", "logger=none", *overrides)
    return Simulation(cfg, fabric, run_dir, data=data)


def bn_layer(model: nn.Module) -> nn.BatchNorm1d:
    return model.body[2]  # Flatten, Linear, BatchNorm1d, ReLU


def replay(sim: Simulation, client: int, rnd: int, stream, start: int | torch.Tensor = 0) -> tuple:
    """Client ``client``'s local training of round ``rnd`` redone with train_local: from server
    model ``start`` (or a state vector); returns its BatchNorm (running_mean, running_var, counter)."""
    module = sim.module
    if isinstance(start, int):
        module.load_working(start)
    else:
        module.load_working(0)
        assign_state_(module.working, start)
    train_local(module, sim.ctx.data, sim.ctx.train_index[client], EPOCHS, BATCH,
                seed=derive_seed(sim.cfg.seed, "local", rnd, client, stream))
    bn = bn_layer(module.working)
    return bn.running_mean.double().clone(), bn.running_var.double().clone(), int(bn.num_batches_tracked)


def weighted(stats: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    return (torch.stack(stats) * w[:, None]).sum(dim=0) / w.sum()


# -- the state vector ---------------------------------------------------------------------------------

def test_state_vector_order_lengths_and_integer_counter():
    model = MODELS.get("mlp")(OmegaConf.create({"hidden": [16], "norm": "batch"}), DataInfo((64,), 10))
    names = [n for n, _ in named_state(model)]
    assert names == ["body.1.weight", "body.1.bias", "body.2.weight", "body.2.bias", "head.weight", "head.bias",
                     "body.2.running_mean", "body.2.running_var", "body.2.num_batches_tracked"]
    d = 64 * 16 + 16 + 2 * 16 + 16 * 10 + 10
    flat = flat_state(model)
    assert flat.shape == (d + 2 * 16 + 1,) and flat.dtype == torch.float32
    flat[d : d + 16] = torch.arange(16.0)  # running_mean
    flat[-1] = 6.6                            # the counter travels as a float ...
    assign_state_(model, flat)
    bn = bn_layer(model)
    assert bn.num_batches_tracked.dtype == torch.int64 and int(bn.num_batches_tracked) == 7  # ... and is rounded back
    assert torch.equal(bn.running_mean, torch.arange(16.0))
    with pytest.raises(ValueError, match="flat vector has 3 entries"):
        assign_state_(model, torch.zeros(3))


def test_norm_key_builds_batchnorm_and_rejects_other_values():
    info = DataInfo((1, 16, 16), 4)
    cnn = MODELS.get("cnn")(OmegaConf.create({"hidden": 8, "norm": "batch"}), info)
    norms = [m for m in cnn.modules() if isinstance(m, nn.BatchNorm2d)]
    assert [m.num_features for m in norms] == [32, 64]
    assert all(float(m.running_mean.abs().sum()) == 0 and int(m.num_batches_tracked) == 0 for m in norms)  # untouched
    plain = MODELS.get("cnn")(OmegaConf.create({"hidden": 8}), info)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    with pytest.raises(ValueError, match=r"model.norm='layer' for model mlp; allowed: none, batch"):
        MODELS.get("mlp")(OmegaConf.create({"norm": "layer"}), DataInfo((64,), 10))
    with pytest.raises(ConfigError, match="model.norm"):
        validate_config(compose_config("model.norm=layer"))


# -- the default policy: statistics averaged with the parameters' weights ------------------------------

def test_fedavg_server_statistics_are_the_sample_weighted_mean(tmp_path, cpu_fabric):
    sim = bn_sim(tmp_path, cpu_fabric, "fedavg")
    local = [replay(sim, i, 1, 0) for i in range(3)]
    n = [float(sim.num_train[i]) for i in range(3)]
    sim.run_round(1)
    server = bn_layer(sim.module.models[0])
    expected_mean = weighted([s[0] for s in local], n)
    assert not torch.allclose(local[0][0], local[1][0], atol=1e-3)  # the clients' statistics differ
    torch.testing.assert_close(server.running_mean.double(), expected_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(server.running_var.double(), weighted([s[1] for s in local], n), rtol=1e-5, atol=1e-6)
    assert int(server.num_batches_tracked) == round(float(weighted([torch.tensor([float(s[2])]) for s in local], n)))


@pytest.mark.parametrize("engine", ["loop", "vmap"])
def test_fedfew_server_statistics_are_the_alpha_w_weighted_mean(tmp_path, cpu_fabric, engine):
    """Model k's statistics: sum_i alpha_i w_ik s_ik / sum_i alpha_i w_ik (normalize=true), the
    weights of its parameters, with the client statistics s_ik of both engines."""
    sim = bn_sim(tmp_path, cpu_fabric, "fedfew", "algorithm.K=2", f"engine={engine}")
    local = {(i, k): replay(sim, i, 1, k, start=k) for i in range(3) for k in range(2)}
    logs = sim.run_round(1)
    weights = logs["alpha"][:, None] * logs["w"]  # (P, K)
    for k in range(2):
        server = bn_layer(sim.module.models[k])
        wk = weights[:, k].tolist()
        torch.testing.assert_close(server.running_mean.double(), weighted([local[i, k][0] for i in range(3)], wk),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(server.running_var.double(), weighted([local[i, k][1] for i in range(3)], wk),
                                   rtol=1e-4, atol=1e-5)
        assert int(server.num_batches_tracked) == round(float(weighted([torch.tensor([float(local[i, k][2])])
                                                                        for i in range(3)], wk)))
    assert float(bn_layer(sim.module.models[0]).running_mean.abs().max()) > 1e-2  # moved from the initial 0


# -- FedBN ------------------------------------------------------------------------------------------

def test_fedbn_keeps_each_clients_batchnorm_across_rounds_and_checkpoints(tmp_path, cpu_fabric):
    sim = bn_sim(tmp_path / "a", cpu_fabric, "fedbn")
    server_bn = flatten_tensors(local_tensors(sim.module.models[0])).clone()
    assert server_bn.numel() == 4 * 16 + 1  # weight, bias, running_mean, running_var, counter
    expected = {}
    for i in range(3):
        replay(sim, i, 1, 0)
        expected[i] = flatten_tensors(local_tensors(sim.module.working))
    sim.run_round(1)
    for i in range(3):
        torch.testing.assert_close(sim.ctx.host_state[i]["bn"], expected[i], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(expected[0], expected[1])
    assert torch.equal(flatten_tensors(local_tensors(sim.module.models[0])), server_bn)  # never averaged
    # round 2: each client trains the new global model with its own BatchNorm layers
    for i in range(3):
        sim.module.load_working(0)
        assign_tensors_(local_tensors(sim.module.working), sim.ctx.host_state[i]["bn"])
        replay(sim, i, 2, 0, start=flat_state(sim.module.working))
        expected[i] = flatten_tensors(local_tensors(sim.module.working))
    sim.run_round(2)
    for i in range(3):
        torch.testing.assert_close(sim.ctx.host_state[i]["bn"], expected[i], rtol=1e-6, atol=1e-7)
        scored = sim.algorithm.candidates(sim.host_data.clients[i])[0]
        assert torch.equal(flatten_tensors(local_tensors(scored)), sim.ctx.host_state[i]["bn"])
    # the same two rounds through a checkpoint written after round 1
    first = bn_sim(tmp_path / "b", cpu_fabric, "fedbn")
    first.run_round(1)
    path = save_checkpoint(tmp_path / "b" / "last.ckpt", first.state_dict(1))
    resumed = bn_sim(tmp_path / "c", cpu_fabric, "fedbn")
    resumed.load_state_dict(load_checkpoint(path))
    resumed.run_round(2)
    for i in range(3):
        torch.testing.assert_close(resumed.ctx.host_state[i]["bn"], sim.ctx.host_state[i]["bn"], rtol=0, atol=0)
    torch.testing.assert_close(flat_state(resumed.module.models[0]), flat_state(sim.module.models[0]), rtol=0, atol=0)


def test_fedbn_local_affine_false_averages_the_affine_weights(tmp_path, cpu_fabric):
    sim = bn_sim(tmp_path, cpu_fabric, "fedbn", "algorithm.local_affine=false")
    sim.run_round(1)
    assert sim.ctx.host_state[0]["bn"].numel() == 2 * 16 + 1  # statistics and counter only
    assert float((bn_layer(sim.module.models[0]).weight.detach() - 1).abs().max()) > 1e-4  # averaged, so it moved


def test_fedbn_without_batchnorm_is_a_clear_error(tmp_path, cpu_fabric):
    with pytest.raises(ConfigError, match=r"algorithm=fedbn with model.norm=none: .*use model.norm=batch"):
        validate_config(compose_config("algorithm=fedbn"))  # before any data is loaded
    validate_config(compose_config("algorithm=fedbn", "model.norm=batch"))
    with pytest.raises(ValueError, match=r"algorithm=fedbn needs a model with BatchNorm layers.*model.norm=batch"):
        bn_sim(tmp_path, cpu_fabric, "fedbn", "model.norm=none")


def test_communication_counts_the_state_that_travels():
    model = MODELS.get("mlp")(OmegaConf.create({"hidden": [16], "norm": "batch"}), DataInfo((64,), 10))
    d, stats = 64 * 16 + 16 + 2 * 16 + 16 * 10 + 10, 2 * 16 + 1

    def comm(name, **keys):
        return ALGORITHMS.get(name).communication(OmegaConf.create(keys), model)

    assert comm("fedavg") == (d + stats, d + stats)
    assert comm("fedfew", K=3) == (3 * (d + stats), 3 * (d + stats))
    assert comm("ifca", K=2) == (d + stats, 2 * (d + stats))
    assert comm("fedrep") == (64 * 16 + 16 + 2 * 16 + stats,) * 2      # the body and its BatchNorm
    assert comm("fedbn") == (d - 2 * 16, d - 2 * 16)                   # BatchNorm layers stay local
    assert comm("fedbn", local_affine=False) == (d, d)                 # only the statistics stay
    assert comm("fedamp") == (d, d)                                     # personal statistics never leave
    assert comm("local") == (0, 0)


# -- a final batch of one sample -------------------------------------------------------------------------

def test_batch_bounds_merge_a_final_single_sample():
    assert batch_bounds(33, 32) == [(0, 32), (32, 33)]
    assert batch_bounds(33, 32, merge_single=True) == [(0, 33)]
    assert batch_bounds(65, 32, merge_single=True) == [(0, 32), (32, 65)]
    assert batch_bounds(34, 32, merge_single=True) == [(0, 32), (32, 34)]
    assert batch_bounds(32, 32, merge_single=True) == [(0, 32)]
    assert batch_bounds(5, 32, merge_single=True) == [(0, 5)]
    assert batch_bounds(0, 32, merge_single=True) == []
    with pytest.raises(ValueError, match="single train sample cannot train a model with BatchNorm"):
        batch_bounds(1, 32, merge_single=True)


def flat_data(sizes: list[int], features: int = 64, classes: int = 4, test: int = 3) -> FederatedData:
    g = torch.Generator().manual_seed(0)
    clients, start = [], 0
    for i, size in enumerate(sizes):
        ids = np.arange(start, start + size + test)
        clients.append(ClientSplit(i, train=ids[:size], test=ids[size:]))
        start += size + test
    return FederatedData(inputs=torch.randn((start, features), generator=g),
                         targets=torch.randint(0, classes, (start,), generator=g), num_classes=classes,
                         clients=clients, partition_hash="bn-33")


@pytest.mark.parametrize("algorithm,overrides,batches", [
    ("fedfew", ("algorithm.K=2", "engine=loop"), 2),
    ("fedfew", ("algorithm.K=2", "engine=vmap"), 2),
    ("fedavg", (), 2),
    ("apfl", (), 2),
    ("fedem", ("algorithm.K=2",), 2),
    ("fedrep", ("algorithm.head_epochs=1",), 3),  # 1 head epoch + 2 body epochs (the body's BatchNorm runs in both)
])
def test_33_samples_at_batch_32_train_as_one_batch_of_33(tmp_path, cpu_fabric, algorithm, overrides, batches):
    """Two clients of 33 train samples at B = 32 with BatchNorm: no crash, and each local epoch is
    one batch of 33 (the server counter counts batches: 2 epochs -> 2, FedRep 1 + 2)."""
    data = flat_data([33, 33])
    sim = bn_sim(tmp_path, cpu_fabric, algorithm, "num_clients=2", "local_epochs=2", *overrides, data=data)
    logs = sim.run_round(1)
    assert bool(torch.isfinite(torch.as_tensor(logs["loss"])).all())
    for model in sim.module.models:
        assert int(bn_layer(model).num_batches_tracked) == batches
    assert 0.0 <= sim.evaluate(1)["summary"]["acc_mean"] <= 1.0


# -- ResNet-18 ------------------------------------------------------------------------------------------

def test_resnet18_is_torchvisions_without_download_with_a_body_and_head(tmp_path, monkeypatch):
    from torchvision.models import resnet18

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # a download would land here
    build = MODELS.get("resnet18")
    torch.manual_seed(0)
    model = build(OmegaConf.create({"name": "resnet18"}), DataInfo((3, 32, 32), 8))
    torch.manual_seed(0)
    reference = resnet18(weights=None, num_classes=8)
    assert not (tmp_path / "torch_home").exists()
    assert sum(p.numel() for p in model.parameters()) == 11_180_616
    assert isinstance(model.head, nn.Linear) and (model.head.in_features, model.head.out_features) == (512, 8)
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    reference.eval()
    assert model.body(x).shape == (2, 512)
    torch.testing.assert_close(model(x), reference(x))  # same modules, order and initialisation
    gray = build(OmegaConf.create({}), DataInfo((1, 28, 28), 10)).eval()
    assert gray.body[0].in_channels == 1 and gray(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match=r"model resnet18 needs image inputs \(C, H, W\)"):
        build(OmegaConf.create({}), DataInfo((64,), 10))


@pytest.mark.slow
def test_fedrep_round_with_resnet18_on_tiny_images(tmp_path, cpu_fabric):
    """32x32 images (the last stage is 1x1: a one-sample batch would fail), clients of 9 and 6
    samples at B = 4 (batches 4 + 5 and 4 + 2): one FedRep round, heads personal, body averaged."""
    g = torch.Generator().manual_seed(0)
    clients = [ClientSplit(0, train=np.arange(9), test=np.arange(9, 11)),
               ClientSplit(1, train=np.arange(11, 17), test=np.arange(17, 19))]
    data = FederatedData(inputs=torch.randn((19, 3, 32, 32), generator=g), targets=torch.randint(0, 4, (19,), generator=g),
                         num_classes=4, clients=clients, partition_hash="resnet-tiny")
    cfg = compose_config("model=resnet18", "algorithm=fedrep", "algorithm.head_epochs=1", "num_clients=2",
                         "dataset.batch_size=4", "optim.lr=0.01", "partition=iid", "logger=none")
    sim = Simulation(cfg, cpu_fabric, tmp_path, data=data)
    logs = sim.run_round(1)
    assert bool(torch.isfinite(torch.as_tensor(logs["loss"])).all())
    heads = [sim.ctx.host_state[i]["head"] for i in range(2)]
    assert heads[0].shape == (512 * 4 + 4,) and not torch.allclose(heads[0], heads[1])
    stem = sim.module.models[0].body[1]  # the first BatchNorm: averaged with the body
    assert int(stem.num_batches_tracked) == 4 and float(stem.running_mean.abs().max()) > 0
    assert 0.0 <= sim.evaluate(1)["summary"]["acc_mean"] <= 1.0


def test_kvasir_and_fedisic_default_to_resnet18_with_the_cnn_one_override_away():
    for name, size in (("kvasir", 64), ("fedisic", 224)):
        cfg = compose_config(f"dataset={name}")
        assert cfg.model.name == "resnet18" and cfg.dataset.image_size == size
        assert compose_config(f"dataset={name}", "model=cnn").model.name == "cnn"
