"""Tuned presets: the files ``make tune`` writes and ``make train``/``make compare`` apply.

A preset is ``conf/tuned/<dataset>_<algorithm>.yaml`` (or under ``conf/tuned/<dataset><setup>/``):
the tuned values as a nested mapping, with comment lines that record how they were found and the
setup they were tuned on (``# setup: ...``). This module reads that format: its values as overrides
(:func:`preset_overrides`), its header (:func:`preset_header`), whether it applies to a run config
(:func:`preset_matches`, :func:`preset_note`). The writer is :mod:`fedfew.experiments.preset_files`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from fedfew.config import CONFIG_DIR
from fedfew.core.checkpoint import ADDED_KEYS
from fedfew.core.keys import changes_setup
from fedfew.data.partition import partition_scheme


class PresetError(ValueError):
    """A preset file is missing or is not a mapping of keys to values."""


#: the presets that apply automatically (conf/tuned/<dataset>_<algorithm>.yaml)
TUNED_DIR = CONFIG_DIR / "tuned"


def fixed_keys(extra: Sequence[str]) -> set[str]:
    """Dotted keys set by the extra overrides (``a.b=1``, ``+a.b=1``, ``++a.b=1``)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in extra if "=" in o}


def preset_overrides(path: str | Path) -> list[str]:
    """A preset file's values as command-line overrides (``optim.lr=0.2``, ``algorithm.mu=0.1``),
    to apply a preset that is not in ``conf/tuned`` (with ``~tuned``, which drops the default one).

    Raises:
        PresetError: the file is missing or not a mapping.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise PresetError(f"preset {path} does not exist")
    content = yaml.safe_load(path.read_text()) or {}
    if not isinstance(content, dict):
        raise PresetError(f"preset {path}: expected a mapping, got {type(content).__name__}")
    return [f"{key}={override_value(value)}" for key, value in _flat(content).items()]


def override_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def describe_setup(cfg) -> str:
    """The setup a preset is tuned for, in words (partition, clients, rounds, budget)."""
    return (f"{cfg.dataset.name}, {partition_scheme(cfg.partition)}, M={cfg.num_clients} clients, {cfg.rounds} rounds, "
            f"{cfg.local_epochs} local epoch(s), batch {cfg.dataset.batch_size}, participation {cfg.participation}, "
            f"model {cfg.model.name}")


def setup_keys(cfg) -> dict[str, Any]:
    """The setup a preset is tuned for, as data: the dataset config (less ``lr``, the search
    range's scale), the partition (less ``val_fraction``, which the tune sets for its trials), the
    model, the local optimizer (less ``lr``, which is searched), M, rounds, local epochs and
    participation. A preset records it in its ``# setup:`` header line; two setups are the same
    when these are equal. The algorithm's own keys are not in it (some are searched)."""
    from omegaconf import OmegaConf

    def plain(node, *drop: str) -> dict[str, Any]:
        out = OmegaConf.to_container(node, resolve=True)
        for key in drop:
            out.pop(key, None)
        return out

    return {"dataset": plain(cfg.dataset, "lr"), "partition": plain(cfg.partition, "val_fraction"),
            "model": plain(cfg.model), "optim": plain(cfg.optim, "lr"), "num_clients": cfg.num_clients,
            "rounds": cfg.rounds, "local_epochs": cfg.local_epochs, "participation": float(cfg.participation),
            "clients_per_round": cfg.get("clients_per_round")}


def preset_header(path: str | Path) -> dict[str, str]:
    """The ``# <field>: <value>`` lines of a preset's header, e.g. ``{"tuned for": "digits, ..."}``."""
    fields = {}
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        field, sep, value = line[1:].partition(":")
        if sep:
            fields.setdefault(field.strip(), value.strip())
    return fields


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (a key "" names its parent)."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}." if key else prefix).items()}


def setup_differences(path: str | Path, cfg) -> list[str] | None:
    """How ``cfg``'s setup differs from the one the preset at ``path`` was tuned for: ``[]`` when
    it is the same, e.g. ``["rounds: 50 in the preset, 1 here"]``, or None when the preset records
    no setup. Compared on its ``# setup:`` line with :func:`setup_keys`; a preset without one (or
    with one that does not parse) on its ``# tuned for:`` line with :func:`describe_setup`."""
    header = preset_header(path)
    try:
        tuned = json.loads(header["setup"]) if "setup" in header else None
    except json.JSONDecodeError:
        tuned = None
    if isinstance(tuned, dict):
        for dotted, default in ADDED_KEYS.items():  # a preset from before the key: it had the old behaviour
            section, _, key = dotted.partition(".")
            if isinstance(tuned.get(section), dict):
                tuned[section].setdefault(key, default)
        here = json.loads(json.dumps(setup_keys(cfg)))
        out = []
        for section in [*tuned, *(k for k in here if k not in tuned)]:
            a, b = tuned.get(section, "(absent)"), here.get(section, "(absent)")
            if a == b:
                continue
            if isinstance(a, dict) and isinstance(b, dict) and a.get("name") != b.get("name"):
                a, b = {"": a.get("name")}, {"": b.get("name")}  # another partition / model / ...: its name says it
            a, b = _flat(a, f"{section}."), _flat(b, f"{section}.")
            out += [f"{key}: {a.get(key, '(absent)')} in the preset, {b.get(key, '(absent)')} here"
                    for key in [*a, *(k for k in b if k not in a)] if a.get(key, "(absent)") != b.get(key, "(absent)")]
        return out
    if "tuned for" in header:
        here_words = describe_setup(cfg)
        return [] if header["tuned for"] == here_words else [f"{header['tuned for']} in the preset, {here_words} here"]
    return None


def preset_matches(path: str | Path, cfg) -> bool | None:
    """Whether the preset at ``path`` was tuned for ``cfg``'s setup (:func:`setup_differences`
    is empty); None when the preset records no setup (a hand-written file)."""
    differences = setup_differences(path, cfg)
    return None if differences is None else not differences


def setup_preset(name: str, cfg) -> Path | None:
    """The preset ``conf/tuned/<setup folder>/<name>`` tuned for ``cfg``'s setup (the first in
    folder order), or None."""
    return next((p for p in sorted(TUNED_DIR.glob(f"*/{name}")) if preset_matches(p, cfg)), None)


def preset_note(choice: str | None, cfg) -> str | None:
    """What a run should be told about its preset ``conf/tuned/<choice>.yaml`` (Hydra's ``tuned``
    choice; None under ``~tuned``): None when it is the run's algorithm's and was tuned for
    ``cfg``'s setup (or records none, or there is none), else what differs, and the ``tuned=``
    choice of a preset in a setup folder that was tuned for this setup."""
    path = TUNED_DIR / f"{choice}.yaml" if choice else None
    if path is None or not path.is_file():
        return None
    own = f"{cfg.dataset.name}_{cfg.algorithm.name}"
    if path.stem != own:
        return f"preset conf/tuned/{choice}.yaml is not {own}'s: its values were tuned for another method"
    differences = setup_differences(path, cfg)
    if not differences:
        return None
    match = setup_preset(path.name, cfg)
    fix = (f"add tuned={match.parent.name}/{match.stem}, tuned for this setup" if match else
           "no preset in conf/tuned was tuned for this setup (make tune with the same overrides makes one: "
           "docs/tuning.md)")
    return f"preset conf/tuned/{choice}.yaml was tuned for another setup ({'; '.join(differences)}): {fix}"


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """{"optim.lr": 0.2, "algorithm.mu": 0.1} -> {"optim": {"lr": 0.2}, "algorithm": {"mu": 0.1}}."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def setup_changing(extra: Sequence[str]) -> list[str]:
    """The extra overrides that change what a preset is tuned for (:func:`fedfew.core.keys.changes_setup`:
    not threads, logging, engines, paths)."""
    return [o for o in extra if changes_setup(o.split("=", 1)[0].lstrip("+~"))]
