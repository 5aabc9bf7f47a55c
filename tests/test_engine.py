"""Local-training engines: ``engine=loop`` and ``engine=vmap`` give the same losses and deltas
(models without dropout), BatchNorm statistics are handled, chunks of several clients,
mixed precision and torch.compile plumbing."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedfew.data.base import ClientSplit, FederatedData
from fedfew.engines import ENGINES
from fedfew.engines.base import ClientJob
from fedfew.engines.loop import LoopEngine
from fedfew.engines.vmap import VmapEngine
from fedfew.core.local_training import train_local
from fedfew.core.model_set import KModelSet, flat_parameters, flat_state
from fedfew.core.seeding import derive_seed
from fedfew.simulator.simulation import Simulation

from conftest import compose_config, real_data_dir

TOL = dict(rtol=1e-5, atol=1e-5)


def images(sizes, shape=(1, 16, 16), classes=4, seed=0, test=2):
    """Synthetic image data: client i has ``sizes[i]`` train and ``test`` test samples."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes) + test * len(sizes)
    clients, start = [], 0
    for i, size in enumerate(sizes):
        ids = np.arange(start, start + size + test)
        clients.append(ClientSplit(i, train=ids[:size], test=ids[size:]))
        start += size + test
    return FederatedData(inputs=torch.randn((n, *shape), generator=g), targets=torch.randint(0, classes, (n,), generator=g),
                         num_classes=classes, clients=clients, partition_hash=f"test-{seed}")


def jobs_for(sim, clients, rnd=1):
    return [ClientJob(c, sim.ctx.train_index[c], [derive_seed(sim.cfg.seed, "local", rnd, c, k) for k in range(sim.module.K)])
            for c in clients]


def run_engine(engine, jobs):
    """{client: (losses, deltas)} with the engine's reused buffers copied out."""
    return {r.client: (r.losses.clone(), r.deltas.clone()) for r in engine.train(jobs)}


def server_flat(module):
    return torch.stack([flat_parameters(m) for m in module.models])


def test_engines_are_registered_by_name():
    assert {"loop", "vmap"} <= set(ENGINES.names())
    with pytest.raises(ValueError, match="unknown engine 'nope'.*loop.*vmap"):
        ENGINES.get("nope")


@pytest.mark.parametrize("loss_source,engines", [
    ("running", [("loop", None), ("vmap", None), ("vmap", 3)]),
    ("pre", [("loop", None), ("vmap", None)]),
])
def test_vmap_round_equals_loop_round_mlp(tmp_path, cpu_fabric, loss_source, engines):
    """Two rounds of FedFew on digits (MLP), 2 local epochs, momentum and weight decay:
    losses, STCH weights and server models agree within 1e-5, one client or three at a time."""
    out = {}
    for engine, chunk in engines:
        cfg = compose_config("num_clients=4", "algorithm.K=3", "local_epochs=2", "dataset.batch_size=64",
                             "optim.lr=0.1", "optim.momentum=0.5", "optim.weight_decay=0.01", "logger=none",
                             f"algorithm.loss_source={loss_source}", f"engine={engine}",
                             *([f"engine_clients={chunk}"] if chunk else []))
        sim = Simulation(cfg, cpu_fabric, tmp_path)
        logs = [sim.run_round(r) for r in (1, 2)]
        out[engine, chunk] = logs, server_flat(sim.module)
    ref_logs, ref_flat = out.pop(("loop", None))
    for logs, flat in out.values():
        for a, b in zip(ref_logs, logs):
            torch.testing.assert_close(b["loss"], a["loss"], **TOL)
            torch.testing.assert_close(b["alpha"], a["alpha"], **TOL)
            torch.testing.assert_close(b["w"], a["w"], **TOL)
        torch.testing.assert_close(flat, ref_flat, **TOL)


def test_vmap_deltas_equal_loop_cnn_with_unequal_clients(tmp_path, cpu_fabric):
    """The CNN, clients of different sizes (partial last batches, a chunk of 3 clients whose
    copies finish at different steps): per-client losses (K,) and deltas (K, d) within 1e-5."""
    cfg = compose_config("model=cnn", "model.hidden=32", "num_clients=4", "algorithm.K=3", "local_epochs=2",
                         "dataset.batch_size=8", "optim.lr=0.05", "optim.momentum=0.9", "logger=none")
    sim = Simulation(cfg, cpu_fabric, tmp_path, data=images([21, 8, 13, 3]))
    jobs = jobs_for(sim, [0, 1, 2, 3])
    loop = run_engine(LoopEngine.from_context(sim.ctx), jobs)
    vmap = VmapEngine(sim.module, sim.data, 2, 8, max_clients=3)
    assert vmap.plan({0: 21, 1: 8, 2: 13, 3: 3}) == [[0, 2, 1], [3]]
    got = run_engine(vmap, jobs[:3]) | run_engine(vmap, jobs[3:])
    assert sorted(got) == [0, 1, 2, 3]
    for c in range(4):
        torch.testing.assert_close(got[c][0], loop[c][0], **TOL)
        torch.testing.assert_close(got[c][1], loop[c][1], **TOL)
        assert got[c][1].abs().max() > 1e-3  # the models did move
    # the three copies of a client see different batches (their own shuffling)
    assert not torch.allclose(loop[0][1][0], loop[0][1][1])


class BNNet(nn.Module):
    def __init__(self, d=64, classes=4):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(d, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.body(x))


def test_vmap_batchnorm_running_statistics_match_loop():
    """BatchNorm under vmap: functional buffers (R, ...) updated in place give the same
    running statistics, losses and deltas as the loop engine's working copy; clients of
    different sizes are never put in one chunk (padding would enter the batch statistics)."""
    K = 2
    data = images([20, 20, 9], shape=(1, 8, 8))
    module = KModelSet(BNNet, K=K, seed=0, lr=0.1)
    flat = torch.stack([flat_state(m) for m in module.models])  # deltas are state-vector deltas
    index = {c.id: torch.as_tensor(c.train) for c in data.clients}
    seeds = {c: [derive_seed(0, "local", 1, c, k) for k in range(K)] for c in index}
    # loop reference, capturing the working copy's statistics after each model
    stats, losses, deltas = {}, {}, {}
    for c in (0, 1):
        for k in range(K):
            module.load_working(k)
            losses[c, k] = train_local(module, data, index[c], 2, 6, seed=seeds[c][k])
            stats[c, k] = (module.working.body[2].running_mean.clone(), module.working.body[2].running_var.clone(),
                           int(module.working.body[2].num_batches_tracked))
            deltas[c, k] = flat_state(module.working) - flat[k]
    engine = VmapEngine(module, data, 2, 6, max_clients=8)
    assert engine.exact_groups
    assert engine.plan({0: 20, 1: 20, 2: 9}) == [[0, 1], [2]]
    got = run_engine(engine, [ClientJob(c, index[c], seeds[c]) for c in (0, 1)])
    buffers = engine.row_buffers(2 * K)
    for c in (0, 1):
        for k in range(K):
            r = c * K + k
            assert got[c][0][k].item() == pytest.approx(losses[c, k], rel=1e-5)
            torch.testing.assert_close(got[c][1][k], deltas[c, k], **TOL)
            assert got[c][1][k].numel() == sum(p.numel() for p in module.working.parameters()) + 2 * 16 + 1
            torch.testing.assert_close(buffers["body.2.running_mean"][r], stats[c, k][0], **TOL)
            torch.testing.assert_close(buffers["body.2.running_var"][r], stats[c, k][1], **TOL)
            assert int(buffers["body.2.num_batches_tracked"][r]) == stats[c, k][2] == 8  # 2 epochs x 4 batches
    # the server models' statistics are untouched by local training
    assert torch.equal(module.models[0].body[2].running_mean, torch.zeros(16))
    with pytest.raises(ValueError, match="BatchNorm"):
        list(engine.train([ClientJob(c, index[c], seeds[c]) for c in (0, 2)]))


def test_textcnn_engines(tmp_path, cpu_fabric):
    """TextCNN. Without dropout and with texts of one length (so both engines cut batches
    alike) loop and vmap agree within 1e-5. With dropout the masks differ by design (vmap:
    one stream per chunk, randomness="different"); vmap is still deterministic and finite."""
    n, L = 60, 16
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 50, (n, L), generator=g)
    clients = [ClientSplit(i, train=np.arange(i * 20, i * 20 + 15), test=np.arange(i * 20 + 15, i * 20 + 20)) for i in range(3)]

    def data():
        return FederatedData(inputs=tokens.clone(), targets=torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(2)),
                             num_classes=4, clients=clients, lengths=torch.full((n,), L), vocab_size=50, partition_hash="t")

    results = {}
    for engine, dropout in [("loop", 0.0), ("vmap", 0.0), ("vmap", 0.5), ("vmap", 0.5)]:
        cfg = compose_config("dataset=agnews", "model.embed_dim=8", "model.channels=4", f"model.dropout={dropout}",
                             "num_clients=3", "algorithm.K=2", "dataset.batch_size=4", "logger=none", f"engine={engine}")
        sim = Simulation(cfg, cpu_fabric, tmp_path, data=data())
        logs = sim.run_round(1)
        results.setdefault((engine, dropout), []).append((logs["loss"], server_flat(sim.module)))
    (l0, f0), = results["loop", 0.0]
    (l1, f1), = results["vmap", 0.0]
    torch.testing.assert_close(l1, l0, **TOL)
    torch.testing.assert_close(f1, f0, **TOL)
    (la, fa), (lb, fb) = results["vmap", 0.5]
    assert torch.equal(la, lb) and torch.equal(fa, fb)
    assert bool(torch.isfinite(la).all()) and not torch.allclose(la, l0)


@pytest.mark.parametrize("engine", ["loop", "vmap"])
def test_bf16_mixed_precision_is_finite_and_weights_stay_float32(tmp_path, engine):
    """precision=bf16-mixed through Fabric: forward in bfloat16, the losses, the STCH-Set
    weights alpha and w (float64, i.e. at least float32) and the server models finite."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    cfg = compose_config("model=cnn", "model.hidden=32", "num_clients=3", "algorithm.K=2", "dataset.batch_size=8",
                         "optim.lr=0.05", "logger=none", f"engine={engine}", "trainer.precision=bf16-mixed")
    sim = Simulation(cfg, fabric, tmp_path, data=images([16, 12, 8]))
    assert sim.ctx.autocast is not None
    with sim.ctx.autocast():  # the forward really runs in bfloat16
        assert sim.module.models[0](sim.data.inputs[:2]).dtype == torch.bfloat16
    logs = sim.run_round(1)
    for key in ("loss", "alpha", "w"):
        assert logs[key].dtype in (torch.float32, torch.float64) and bool(torch.isfinite(logs[key]).all())
    assert float(logs["alpha"].sum()) == pytest.approx(1.0)
    torch.testing.assert_close(logs["w"].sum(dim=1), torch.ones(3, dtype=logs["w"].dtype))
    assert all(p.dtype == torch.float32 and bool(torch.isfinite(p).all()) for p in sim.module.models.parameters())
    assert bool((logs["loss"] > 0).all())


def test_compile_plumbing_matches_eager(tmp_path, cpu_fabric):
    """compile=<backend> wraps the local step with torch.compile (aot_eager here: no C++
    toolchain needed) and changes nothing in the result."""
    out = {}
    for engine, compile_ in [("loop", "false"), ("vmap", "aot_eager")]:
        cfg = compose_config("num_clients=3", "partition=dirichlet", "algorithm.K=2", "dataset.batch_size=64",
                             "logger=none", f"engine={engine}", f"compile={compile_}")
        sim = Simulation(cfg, cpu_fabric, tmp_path)
        out[engine] = sim.run_round(1)["loss"], server_flat(sim.module)
    torch.testing.assert_close(out["vmap"][0], out["loop"][0], **TOL)
    torch.testing.assert_close(out["vmap"][1], out["loop"][1], **TOL)


def test_group_by_length_same_in_both_engines(tmp_path, cpu_fabric):
    """Texts of varied lengths with ``dataset.group_by_length``: loop and vmap draw the same
    length-grouped batches (padding is masked, so cutting widths do not matter) and agree within
    1e-5; the grouped order trains differently from the plain shuffled one. The AG News model's
    embedding reparametrisation (``model.embed_lr_scale`` != 1) runs through both engines here."""
    n, L = 60, 16
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, L + 1, (n,), generator=g)
    tokens = torch.randint(2, 50, (n, L), generator=g) * (torch.arange(L)[None, :] < lengths[:, None])
    targets = torch.randint(0, 4, (n,), generator=g)
    clients = [ClientSplit(i, train=np.arange(i * 20, i * 20 + 15), test=np.arange(i * 20 + 15, i * 20 + 20)) for i in range(3)]
    out = {}
    for engine, grouped in [("loop", True), ("vmap", True), ("loop", False)]:
        cfg = compose_config("dataset=agnews", "model.embed_dim=8", "model.channels=4", "model.dropout=0.0",
                             "num_clients=3", "algorithm.K=2", "dataset.batch_size=4", "logger=none", f"engine={engine}",
                             f"dataset.group_by_length={grouped}")
        assert cfg.model.embed_lr_scale != 1 and cfg.model.embed_init_std != 1
        data = FederatedData(inputs=tokens.clone(), targets=targets.clone(), num_classes=4, clients=clients,
                             lengths=lengths.clone(), vocab_size=50, partition_hash="t", group_by_length=grouped)
        sim = Simulation(cfg, cpu_fabric, tmp_path, data=data)
        logs = sim.run_round(1)
        out[engine, grouped] = logs["loss"], server_flat(sim.module)
    torch.testing.assert_close(out["vmap", True][0], out["loop", True][0], **TOL)
    torch.testing.assert_close(out["vmap", True][1], out["loop", True][1], **TOL)
    assert not torch.allclose(out["loop", False][1], out["loop", True][1])


def test_group_by_length_reaches_the_data_from_the_config(tmp_path, monkeypatch):
    """``dataset.group_by_length`` travels from the config to the built text data (real AG News),
    and grouped epochs of a real client pad less than shuffled ones."""
    from fedfew.data.federated import build_federated_data

    data_dir = real_data_dir("ag_news_csv/train.csv")
    monkeypatch.setenv("FEDFEW_CACHE_DIR", str(tmp_path / "cache"))
    built = {flag: build_federated_data(compose_config("dataset=agnews", f"data_dir={data_dir}",
                                                       f"dataset.group_by_length={flag}"))
             for flag in (False, True)}
    assert built[False].group_by_length is False and built[True].group_by_length is True
    client = max(built[True].clients, key=lambda c: len(c.train))  # a few hundred texts, several batches
    index = torch.as_tensor(client.train)

    def padded_columns(data):
        order = data.epoch_order(index, 100, torch.Generator().manual_seed(0))
        return sum(int(data.lengths[order[s:s + 100]].max()) * len(order[s:s + 100]) for s in range(0, len(order), 100))

    assert padded_columns(built[True]) < 0.8 * padded_columns(built[False])
