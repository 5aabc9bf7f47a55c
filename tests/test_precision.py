"""bf16 on a CPU that emulates it: said before any data is read (fedfew.core.precision).

Measured on this project's AVX2-only machine (2026-12-07): a CIFAR-10 apfl round took 2,019 s in
bf16-mixed against ~62 s where the CPU has native bf16, so the tune of that day stopped. Whether
the CPU has native bf16 is patched here, so the tests hold on every machine."""
from __future__ import annotations

import logging

import pytest

from conftest import compose_config
from fedfew.core import precision

SETUP = ("dataset=digits", "num_clients=4", "rounds=1", "algorithm=fedavg", "logger=none", "partition=iid")


@pytest.fixture
def emulated_bf16(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)


@pytest.mark.parametrize("overrides, slow", [
    (("trainer.precision=bf16-mixed", "trainer.accelerator=cpu"), True),
    (("trainer.precision=bf16-true", "trainer.accelerator=cpu"), True),
    (("trainer.precision=32-true", "trainer.accelerator=cpu"), False),
    (("trainer.precision=bf16-mixed", "trainer.accelerator=cuda"), False),  # a GPU run: not the CPU's kernels
])
def test_note_names_the_fix(emulated_bf16, overrides, slow):
    note = precision.slow_precision_note(compose_config(*SETUP, *overrides))
    assert (note is not None) == slow
    if slow:
        assert "without native bf16" in note and "trainer.precision=32-true" in note


def test_no_note_where_bf16_is_native(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert precision.slow_precision_note(compose_config(*SETUP, "trainer.precision=bf16-mixed",
                                                        "trainer.accelerator=cpu")) is None


def test_tools_say_it_once_before_any_run(emulated_bf16, capsys):
    from fedfew.experiments.tuning import warn_slow_precision

    configs = [compose_config(*SETUP, f"algorithm={a}", "trainer.precision=bf16-mixed", "trainer.accelerator=cpu")
               for a in ("fedavg", "fedfew")]
    warn_slow_precision(configs)
    out = capsys.readouterr().out
    assert out.count("warning: trainer.precision=bf16-mixed on a CPU without native bf16") == 1
    warn_slow_precision([compose_config(*SETUP, "trainer.accelerator=cpu")])  # fp32: nothing
    assert capsys.readouterr().out == ""


def test_a_run_says_it_before_reading_data(emulated_bf16, tmp_path, caplog, monkeypatch):
    from fedfew.data import federated
    from fedfew.experiments.training import run

    said_before_data: list[bool] = []
    build = federated.build_federated_data

    def recording(cfg):
        said_before_data.append("without native bf16" in caplog.text)
        return build(cfg)

    monkeypatch.setattr(federated, "build_federated_data", recording)
    with caplog.at_level(logging.WARNING, logger="fedfew.experiments.training"):
        run(compose_config(*SETUP, "trainer.precision=bf16-mixed", "trainer.accelerator=cpu"), tmp_path)
    assert said_before_data == [True]



def test_flower_simulation_says_it_before_reading_data(emulated_bf16, tmp_path, capsys, monkeypatch):
    """python -m fedfew.flower (and make bench's Flower rows) run every virtual SuperNode on this CPU:
    the simulation says it before the engine starts (and builds the data), as make train does."""
    import flwr.simulation

    from fedfew.flower.__main__ import simulate

    said_before_engine: list[bool] = []

    def no_engine(*args, **kwargs):
        said_before_engine.append("without native bf16" in capsys.readouterr().err)

    monkeypatch.setattr(flwr.simulation, "run_simulation", no_engine)
    with pytest.raises(RuntimeError, match="ended without results"):
        simulate(compose_config(*SETUP, "trainer.precision=bf16-mixed", "trainer.accelerator=cpu"), tmp_path)
    assert said_before_engine == [True]
