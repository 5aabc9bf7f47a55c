"""Validation of a run config before any data is loaded or model built.

Each rule names the key, the allowed range and a check; :func:`validate_config` reports
every violated rule at once. The README's configuration table is :data:`RULES`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import DictConfig


class ConfigError(ValueError):
    """One or more config values are out of range; the message lists key, value and range."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Rule:
    """key: dotted config key; allowed: human text; check: value -> bool; when: cfg -> bool."""

    key: str
    allowed: str
    check: Callable[[Any], bool]
    when: Callable[[DictConfig], bool] = lambda cfg: True


RULES: list[Rule] = [
    Rule("seed", "integer >= 0", lambda v: _is_int(v) and v >= 0),
    Rule("num_clients", "integer >= 1", lambda v: _is_int(v) and v >= 1),
    Rule("rounds", "integer >= 1", lambda v: _is_int(v) and v >= 1),
    Rule("local_epochs", "integer >= 1", lambda v: _is_int(v) and v >= 1),
    Rule("eval_every", "integer >= 1", lambda v: _is_int(v) and v >= 1),
    Rule("participation", "number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1),
    Rule("checkpoint_every", "integer >= 0 (0: only on SIGTERM/SIGUSR1)", lambda v: _is_int(v) and v >= 0),
    Rule("clients_per_round", "null or integer >= 1", lambda v: v is None or (_is_int(v) and v >= 1)),
    Rule("optim.lr", "number > 0", lambda v: _is_number(v) and v > 0),
    Rule("optim.momentum", "number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1),
    Rule("optim.weight_decay", "number >= 0", lambda v: _is_number(v) and v >= 0),
    Rule("dataset.batch_size", "integer >= 1", lambda v: _is_int(v) and v >= 1),
    Rule("algorithm.K", "integer >= 1", lambda v: _is_int(v) and v >= 1, lambda c: "K" in c.algorithm),
    Rule("algorithm.mu", "number > 0", lambda v: _is_number(v) and v > 0, lambda c: "mu" in c.algorithm),
    Rule("algorithm.server_lr", "number > 0", lambda v: _is_number(v) and v > 0, lambda c: "server_lr" in c.algorithm),
    Rule("partition.alpha", "number > 0 (Dirichlet concentration)", lambda v: _is_number(v) and v > 0,
         lambda c: c.partition.name == "dirichlet"),
    Rule("partition.min_size", "integer >= 2 (a client needs 1 train + 1 test sample)", lambda v: _is_int(v) and v >= 2,
         lambda c: c.partition.name == "dirichlet"),
    Rule("partition.max_retries", "integer >= 1", lambda v: _is_int(v) and v >= 1,
         lambda c: c.partition.name == "dirichlet"),
    Rule("partition.classes_per_client", "integer >= 1 (and <= the number of classes)",
         lambda v: _is_int(v) and v >= 1, lambda c: c.partition.name == "pathological"),
    Rule("partition.test_fraction", "number in (0, 1)", lambda v: _is_number(v) and 0 < v < 1),
    Rule("partition.val_fraction", "number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1),
    Rule("trainer.devices", "integer >= 1 or 'auto'", lambda v: v == "auto" or (_is_int(v) and v >= 1)),
    Rule("trainer.num_nodes", "integer >= 1", lambda v: _is_int(v) and v >= 1),
]


def _lookup(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def validate_config(cfg: DictConfig) -> None:
    """Check every rule of :data:`RULES` plus cross-key constraints.

    Raises:
        ConfigError: listing each offending key, its value and the allowed range.
    """
    problems = []
    for rule in RULES:
        try:
            applies = rule.when(cfg)
        except Exception:  # a missing group node means the rule does not apply
            applies = False
        if not applies:
            continue
        value = _lookup(cfg, rule.key)
        if value is _MISSING:
            continue
        if not rule.check(value):
            problems.append(f"  {rule.key}={value!r}: allowed {rule.allowed}")
    K = _lookup(cfg, "algorithm.K")
    M = _lookup(cfg, "num_clients")
    if (_is_int(K) and _is_int(M) and K > M and cfg.partition.name != "natural"):
        problems.append(
            f"  algorithm.K={K} > num_clients={M}: more shared models than clients leaves models that no "
            "client can select; use K <= num_clients"
        )
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(problems))


def rules_markdown() -> str:
    """The validated keys and their ranges as a Markdown table (pasted into the README)."""
    lines = ["| key | allowed |", "|---|---|"]
    lines += [f"| `{rule.key}` | {rule.allowed} |" for rule in RULES]
    lines.append("| `algorithm.K` vs `num_clients` | K <= M (a model no client can select is wasted) |")
    return "\n".join(lines)
