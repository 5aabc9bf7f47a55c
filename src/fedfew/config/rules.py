"""Validation of a run config before any data is loaded or model built.

Each rule names the key, the allowed range and a check; :func:`validate_config` reports
every violated rule at once. The README's configuration table is :data:`RULES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import DictConfig, ListConfig

from fedfew.core.allowed import check_of
from fedfew.core.allowed import is_int as _is_int
from fedfew.core.allowed import is_number as _is_number
from fedfew.core.registry import declared, registered_names


class ConfigError(ValueError):
    """One or more config values are out of range; the message lists key, value and range."""


def _is_list(v: Any) -> bool:
    return isinstance(v, (list, tuple, ListConfig))


#: the package whose modules implement ``algorithm=<name>``
ALGORITHMS = "fedfew.algorithms"


def _uses_engine(algorithm: str) -> bool:
    """Whether ``algorithm`` trains through an engine (its class's ``uses_engine``, read from the
    source: validation imports no torch)."""
    return bool(declared(ALGORITHMS, algorithm, "uses_engine", False))


def _text(value: Any) -> str:
    """A value as it is written on the command line (``true``, ``vmap``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _scheme(cfg: DictConfig) -> str:
    """The label-split scheme in force: ``partition.name``, or ``partition.within`` for clustered."""
    name = cfg.partition.name
    return str(cfg.partition.get("within", "iid")) if name == "clustered" else str(name)


@dataclass(frozen=True)
class Rule:
    """key: dotted config key; allowed: human text; check: value -> bool; when: cfg -> bool (the
    configs that use the key); used_by: those configs in words, for a key that ``when`` makes
    depend on a choice (:func:`ignored_key`)."""

    key: str
    allowed: str
    check: Callable[[Any], bool]
    when: Callable[[DictConfig], bool] = lambda cfg: True
    used_by: str = ""


def _applies(rule: Rule, cfg: DictConfig) -> bool:
    """Whether ``rule`` applies to ``cfg`` (a missing group node: it does not)."""
    try:
        return bool(rule.when(cfg))
    except Exception:
        return False


def algorithm_rules(name: str) -> list[Rule]:
    """The rules of algorithm ``name``'s own keys: its class's ``key_rules`` (``{key: allowed text}``,
    read from the source without importing it, :func:`fedfew.core.registry.declared`), each checked
    by :func:`check_of`. Empty for an unknown name (reported elsewhere)."""
    declared_rules = declared(ALGORITHMS, name, "key_rules", {}) or {}
    return [Rule(f"algorithm.{key}", allowed, check_of(allowed), lambda c, k=key: k in c.algorithm, f"algorithm={name}")
            for key, allowed in declared_rules.items()]


#: who uses the label-split keys (partition.within: the split inside a clustered partition's groups)
DIRICHLET = "partition=dirichlet, or partition=clustered with partition.within=dirichlet"
PATHOLOGICAL = "partition=pathological, or partition=clustered with partition.within=pathological"


RULES: list[Rule] = [
    Rule("seed", "integer >= 0", lambda v: _is_int(v) and v >= 0),
    Rule("num_clients", "integer >= 1 (null only with partition=natural)", lambda v: _is_int(v) and v >= 1,
         lambda c: c.partition.name != "natural"),
    Rule("num_clients", "partition=natural: null (every writer/centre found) or integer >= 1 (a cap)",
         lambda v: v is None or (_is_int(v) and v >= 1), lambda c: c.partition.name == "natural"),
    Rule("rounds", "integer >= 1", lambda v: _is_int(v) and v >= 1),
    Rule("local_epochs", "integer >= 1", lambda v: _is_int(v) and v >= 1),
    Rule("eval_every", "integer >= 1", lambda v: _is_int(v) and v >= 1),
    Rule("eval.protocol", "final | finetune | reference (reference: optimistic, best round on test)",
         lambda v: v in ("final", "finetune", "reference")),
    Rule("eval.finetune_epochs", "integer >= 1 (finetune / reference)", lambda v: _is_int(v) and v >= 1),
    Rule("eval.split", "test | val (val: score on the validation split, never on test; needs partition.val_fraction > 0)",
         lambda v: v in ("test", "val")),
    Rule("eval.also", "list of distinct protocols among final, finetune, reference, without eval.protocol "
                      "(e.g. [finetune])",
         lambda v: _is_list(v) and all(p in ("final", "finetune", "reference") for p in v) and len(set(v)) == len(v)),
    Rule("participation", "number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1),
    Rule("checkpoint_every", "integer >= 0 (0: only on SIGTERM/SIGUSR1/Ctrl-C)", lambda v: _is_int(v) and v >= 0),
    Rule("resume_extend_rounds", "true | false (true: a resume may raise rounds above the checkpoint's)",
         lambda v: isinstance(v, bool)),
    Rule("clients_per_round", "null or integer >= 1", lambda v: v is None or (_is_int(v) and v >= 1)),
    Rule("optim.name", "sgd | adam | adamw", lambda v: v in ("sgd", "adam", "adamw")),
    Rule("optim.lr", "number > 0", lambda v: _is_number(v) and v > 0),
    Rule("optim.momentum", "number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1),
    Rule("optim.weight_decay", "number >= 0", lambda v: _is_number(v) and v >= 0),
    Rule("optim.clip_norm", "null (no clipping) or number > 0 (max L2 norm of a local step's gradient)",
         lambda v: v is None or (_is_number(v) and v > 0)),
    Rule("optim.schedule", "constant | exponential | cosine (local lr over rounds)",
         lambda v: v in ("constant", "exponential", "cosine")),
    Rule("optim.gamma", "number in (0, 1] (exponential: lr * gamma^(round-1))", lambda v: _is_number(v) and 0 < v <= 1),
    Rule("optim.warmup_rounds", "integer >= 0 (linear warm-up of the local lr)", lambda v: _is_int(v) and v >= 0),
    Rule("optim.min_lr", "number in [0, optim.lr] (cosine: the last round's lr)", lambda v: _is_number(v) and v >= 0),
    Rule("dataset.batch_size", "integer >= 1", lambda v: _is_int(v) and v >= 1),
    Rule("model.embed_init_std", "number > 0 (std of the initial word vectors)", lambda v: _is_number(v) and v > 0,
         lambda c: "embed_init_std" in c.model),
    Rule("model.embed_lr_scale", "number > 0 (SGD speed of the word vectors relative to the other weights)",
         lambda v: _is_number(v) and v > 0, lambda c: "embed_lr_scale" in c.model),
    Rule("model.norm", "none | batch (mlp, cnn: a BatchNorm after each hidden layer)", lambda v: v in ("none", "batch"),
         lambda c: "norm" in c.model),
    Rule("partition.alpha", "number > 0 (Dirichlet concentration)", lambda v: _is_number(v) and v > 0,
         lambda c: _scheme(c) == "dirichlet", DIRICHLET),
    Rule("partition.min_size", "integer >= 2 (a client needs 1 train + 1 test sample)", lambda v: _is_int(v) and v >= 2,
         lambda c: _scheme(c) == "dirichlet", DIRICHLET),
    Rule("partition.max_retries", "integer >= 1", lambda v: _is_int(v) and v >= 1,
         lambda c: _scheme(c) == "dirichlet", DIRICHLET),
    Rule("partition.classes_per_client", "integer >= 1 (and <= the number of classes)",
         lambda v: _is_int(v) and v >= 1, lambda c: _scheme(c) == "pathological", PATHOLOGICAL),
    Rule("partition.groups", "integer >= 1 and <= num_clients (clustered: client groups)",
         lambda v: _is_int(v) and v >= 1, lambda c: c.partition.name == "clustered", "partition=clustered"),
    Rule("partition.group_transform", "rotate (images, groups <= 4) | permute_labels",
         lambda v: v in ("rotate", "permute_labels"), lambda c: c.partition.name == "clustered", "partition=clustered"),
    Rule("partition.group_data", "replicate | split (clustered)", lambda v: v in ("replicate", "split"),
         lambda c: c.partition.name == "clustered", "partition=clustered"),
    Rule("partition.within", "iid | dirichlet | pathological (clustered: label split inside a group)",
         lambda v: v in ("iid", "dirichlet", "pathological"), lambda c: c.partition.name == "clustered",
         "partition=clustered"),
    Rule("partition.client_sample", "first | random (natural: which groups become clients when num_clients caps them)",
         lambda v: v in ("first", "random"), lambda c: c.partition.name == "natural", "partition=natural"),
    Rule("partition.test_fraction", "number in (0, 1)", lambda v: _is_number(v) and 0 < v < 1),
    Rule("partition.val_fraction", "number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1),
    Rule("engine", "loop | vmap (vmap: FedFew only, SGD only)", lambda v: v in ("loop", "vmap")),
    Rule("engine_clients", "auto or integer >= 1 (vmap: clients trained together)",
         lambda v: v == "auto" or (_is_int(v) and v >= 1)),
    Rule("compile", "false | true | a torch.compile backend name (e.g. aot_eager)",
         lambda v: isinstance(v, bool) or (isinstance(v, str) and v != "")),
    Rule("trainer.devices", "integer >= 1 or 'auto'", lambda v: v == "auto" or (_is_int(v) and v >= 1)),
    Rule("trainer.num_nodes", "integer >= 1", lambda v: _is_int(v) and v >= 1),
    Rule("trainer.threads", "null (torch's default) or integer >= 1 (torch threads per process)",
         lambda v: v is None or (_is_int(v) and v >= 1)),
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
    name = _lookup(cfg, "algorithm.name")
    for rule in [*RULES, *(algorithm_rules(name) if isinstance(name, str) else [])]:
        if not _applies(rule, cfg):
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
    if K == "auto":  # fedfew.stch.auto_k
        K_max, K_min = _lookup(cfg, "algorithm.K_max"), _lookup(cfg, "algorithm.K_min")
        if K_max is _MISSING:
            problems.append(f"  algorithm.K=auto: algorithm={_lookup(cfg, 'algorithm.name')} has no automatic K (only "
                            "fedfew and fedfew_reference, which have algorithm.K_max); give an integer algorithm.K")
        elif _is_int(K_max) and _is_int(M) and K_max > M and cfg.partition.name != "natural":
            problems.append(f"  algorithm.K_max={K_max} > num_clients={M}: K=auto starts with K_max models and a "
                            "model no client can select is wasted; use K_max <= num_clients")
        if _is_int(K_max) and _is_int(K_min) and K_min > K_max:
            problems.append(f"  algorithm.K_min={K_min} > algorithm.K_max={K_max}: K=auto keeps between K_min and "
                            "K_max models; use K_min <= K_max")
    schedule, mu, mu_end = (_lookup(cfg, f"algorithm.{k}") for k in ("mu_schedule", "mu", "mu_end"))
    if schedule in ("cosine", "exponential") and _is_number(mu) and _is_number(mu_end) and mu_end > mu:
        problems.append(f"  algorithm.mu_end={mu_end!r} > algorithm.mu={mu!r} with mu_schedule={schedule}: the schedule "
                        "decreases mu from algorithm.mu to mu_end; use mu_end <= mu (or mu_schedule=constant)")
    if cfg.partition.name == "clustered":
        G = _lookup(cfg, "partition.groups")
        if _is_int(G) and _is_int(M) and G > M:
            problems.append(f"  partition.groups={G} > num_clients={M}: every group needs a client; "
                            "use partition.groups <= num_clients")
        if _lookup(cfg, "partition.group_transform") == "rotate":
            if _is_int(G) and G > 4:
                problems.append(f"  partition.groups={G} with partition.group_transform=rotate: only 4 rotations "
                                "(0/90/180/270 degrees) exist; use groups <= 4 or group_transform=permute_labels")
            if _lookup(cfg, "dataset.kind") == "text":
                problems.append(f"  partition.group_transform=rotate on {cfg.dataset.name} (text): rotations need "
                                "images; use partition.group_transform=permute_labels")
    if _lookup(cfg, "algorithm.name") == "oracle" and cfg.partition.name != "clustered":
        problems.append(f"  algorithm=oracle with partition={cfg.partition.name}: the oracle trains one model per "
                        "known client group; use partition=clustered")
    elif _lookup(cfg, "algorithm.name") == "oracle":
        K, G = _lookup(cfg, "algorithm.K"), _lookup(cfg, "partition.groups")
        if _is_int(K) and _is_int(G) and K != G:
            problems.append(f"  algorithm=oracle with algorithm.K={K} and partition.groups={G}: the oracle trains one "
                            "model per group; leave algorithm.K at its default (partition.groups)")
    if _lookup(cfg, "algorithm.name") == "fedbn" and _lookup(cfg, "model.norm") == "none":
        problems.append(f"  algorithm=fedbn with model.norm=none: FedBN keeps each client's BatchNorm layers local and "
                        f"model {_lookup(cfg, 'model.name')} has none; use model.norm=batch (or model=resnet18)")
    optimizer, engine = _lookup(cfg, "optim.name"), _lookup(cfg, "engine")
    if engine == "vmap" and optimizer not in (_MISSING, "sgd"):
        problems.append(f"  engine=vmap with optim.name={optimizer!r}: the vmap engine implements SGD only; "
                        "use engine=loop or optim.name=sgd")
    algorithm, compiled = _lookup(cfg, "algorithm.name"), _lookup(cfg, "compile")
    for key, value, default in (("engine", engine, "loop"), ("compile", compiled, False)):
        if value not in (_MISSING, default) and isinstance(algorithm, str) and not _uses_engine(algorithm):
            users = [name for name in registered_names(ALGORITHMS) if _uses_engine(name)]
            problems.append(f"  {key}={_text(value)} with algorithm={algorithm}: only {' and '.join(users)} train "
                            f"through an engine; {algorithm} trains with its own loop and would ignore "
                            f"{key}={_text(value)}; use {key}={_text(default)} (the default) or algorithm={users[0]}")
    lr, min_lr = _lookup(cfg, "optim.lr"), _lookup(cfg, "optim.min_lr")
    # only where it is used, and only against a valid lr (a bad lr is reported once, by its own rule)
    if _lookup(cfg, "optim.schedule") == "cosine" and _is_number(lr) and lr > 0 and _is_number(min_lr) and min_lr > lr:
        problems.append(f"  optim.min_lr={min_lr!r} > optim.lr={lr!r}: the cosine schedule anneals from optim.lr "
                        "down to optim.min_lr; use min_lr <= lr")
    sigma = _lookup(cfg, "algorithm.sigma")
    if _is_int(K) and K >= 1 and _is_number(sigma) and sigma > 1.0 / K:
        problems.append(
            f"  algorithm.sigma={sigma!r} > 1/algorithm.K = {1.0 / K:g}: the importance floor must be <= 1/K "
            "(K floored weights must fit in a row summing to 1)"
        )
    if _lookup(cfg, "eval.split") == "val" and _lookup(cfg, "partition.val_fraction") in (0, 0.0):
        problems.append("  eval.split=val with partition.val_fraction=0: there is no validation split to score on; "
                        "use partition.val_fraction=0.2 (for example) or eval.split=test")
    also = _lookup(cfg, "eval.also")
    if _is_list(also) and _lookup(cfg, "eval.protocol") in also:
        problems.append(f"  eval.also={list(also)} repeats eval.protocol={_lookup(cfg, 'eval.protocol')}: the run's own "
                        "protocol is always scored; list only the others")
    if _lookup(cfg, "eval.split") == "val" and _lookup(cfg, "eval.protocol") == "reference":
        problems.append("  eval.split=val with eval.protocol=reference: the reference protocol picks the best round "
                        "on test; use eval.protocol=final or finetune when scoring on the validation split")
    if _lookup(cfg, "eval.split") == "val" and _is_list(also) and "reference" in also:
        problems.append(f"  eval.split=val with eval.also={list(also)}: the reference protocol picks the best round "
                        "on test; leave reference out of eval.also when scoring on the validation split")
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(problems))


def ignored_key(cfg: DictConfig, key: str) -> str | None:
    """Why a run with ``cfg`` ignores ``key``, or None when it uses it: a key is ignored when
    :data:`RULES` has rules for it and none applies, e.g. ``partition.alpha`` under
    ``partition=clustered`` with ``within=iid``. Keys without a rule count as used. The text names
    the choice that ignores the key and the choices that use it; :mod:`fedfew.config.overrides` refuses
    an explicit override of such a key (it would change nothing, and its value is not checked).
    """
    rules = [rule for rule in RULES if rule.key == key]
    if not rules or any(_applies(rule, cfg) for rule in rules):
        return None
    if key.startswith("partition."):
        name = _lookup(cfg, "partition.name")
        chosen = f"partition={name}" + (f" (within={_scheme(cfg)})" if name == "clustered" else "")
    else:
        chosen = "configuration"
    used_by = "; ".join(dict.fromkeys(rule.used_by for rule in rules if rule.used_by)) or "other configurations"
    return f"the chosen {chosen} ignores it; {key} is used by {used_by}: drop it, or choose one of those"


def rules_markdown() -> str:
    """The validated keys and their ranges as a Markdown table (pasted into the README)."""
    lines = ["| key | allowed |", "|---|---|"]
    lines += [f"| `{rule.key}` | {rule.allowed} |" for rule in RULES]
    # each method's own keys, from its class's key_rules: one row per (key, allowed text)
    methods: dict[tuple[str, str], list[str]] = {}
    for name in registered_names(ALGORITHMS):
        for rule in algorithm_rules(name):
            methods.setdefault((rule.key, rule.allowed), []).append(name)
    lines += [f"| `{key}` | {', '.join(names)}: {allowed} |" for (key, allowed), names in sorted(methods.items())]
    lines.append("| `algorithm.K` vs `num_clients` | K <= M (a model no client can select is wasted) |")
    lines.append("| `algorithm.K=auto` | only where the algorithm has `K_max` (fedfew); K_min <= K_max <= M |")
    lines.append("| `algorithm.mu_end` vs `algorithm.mu` | mu_end <= mu with mu_schedule=cosine or exponential |")
    lines.append("| `algorithm.sigma` vs `algorithm.K` | sigma <= 1/K where both exist (fedsoft's importance floor) |")
    lines.append("| `partition.groups` vs `num_clients` | groups <= M; rotate: groups <= 4 and image data |")
    lines.append("| `algorithm=oracle` vs `partition` | the oracle needs partition=clustered |")
    lines.append("| `algorithm=fedbn` vs `model.norm` | fedbn needs BatchNorm layers: model.norm=batch (mlp, cnn) |")
    lines.append("| `engine` vs `optim.name` | engine=vmap needs optim.name=sgd |")
    lines.append("| `engine`, `compile` vs `algorithm` | engine=vmap and compile need a method that trains through an "
                 "engine (fedfew, fedfew_reference) |")
    lines.append("| `eval.split` vs `partition.val_fraction`, `eval.protocol` | split=val needs val_fraction > 0 and "
                 "protocol final or finetune |")
    lines.append("| `optim.min_lr` vs `optim.lr` | min_lr <= lr (the cosine schedule anneals from lr down to min_lr) |")
    return "\n".join(lines)
