"""The round log: one contract between :meth:`Algorithm.end_round` and every place that reads it.

``end_round`` returns a dict, the round loop adds its own keys (:data:`LOOP_KEYS`), and the sinks
(metrics.csv and the CSV logger, W&B, the console, history.json.gz and its plots) write each key by
the kind its method *declares*, never by its name or its length. A method declares every key its
``end_round`` may return in ``log_keys``, beside ``row_shapes``; a subclass extends its parent's::

    log_keys = {**Averaging.log_keys, "personal_loss": Kind.PER_CLIENT}

The kinds (P: the round's participants, in their order; K: :attr:`Algorithm.model_count`, the
server models of the round) and where each one lands:

================  =====================================  ====================================================
kind              value                                  sinks
================  =====================================  ====================================================
scalar            a number (int, float, 0-dim tensor)    metrics.csv ``<name>``, W&B ``train/<name>``
per_client        a tensor of P numbers: (P,) or (P, 1)  metrics.csv ``<name>_mean``; W&B round table column
per_model         a tensor (K,)                          ``<name>/<model id>`` in metrics.csv and W&B
per_client_model  a tensor (P, K)                        metrics.csv ``<name>_mean``; W&B round table columns
record            anything JSON-able (ids, text)         history.json.gz only
================  =====================================  ====================================================

A few names carry a meaning the sinks know, each allowed only the kinds of
:data:`STANDARD_KINDS`: ``loss`` (training loss; metrics.csv ``train_loss_mean`` and
``train_loss_best_mean`` instead of a mean column), ``alpha`` (client weights; W&B ``alpha/...``,
no mean column), ``w`` (client-model weights; W&B heatmap, no mean column), ``assignment`` (the
model each participant counts as served by; ``clients_served/<k>`` instead of a mean column),
``effective_step`` (the collapse watch), ``model_ids`` (the K ids naming the per-model entries and
the assignment's values: FedFew, whose ``K=auto`` retires models), ``model_set_change`` (the text
of a retirement: a metrics.csv column) and ``g`` (FedFew's objective: the console).

history.json.gz keeps every key of every round as it is (tensors as lists), and records the
declaration (``log_keys``) beside them.
"""
from __future__ import annotations

import numbers
from enum import Enum
from typing import Any, Mapping

import torch


class Kind(str, Enum):
    """What one value of a round log is (module docstring)."""

    SCALAR = "scalar"
    PER_CLIENT = "per_client"
    PER_MODEL = "per_model"
    PER_CLIENT_MODEL = "per_client_model"
    RECORD = "record"


#: a method's declaration: round-log key -> its kind
LogKeys = Mapping[str, Kind]

#: the keys the round loop adds to every round's log (:meth:`fedfew.simulator.simulation.Simulation.run_round`):
#: the round, its participants (ids, the order of every per_client value), seconds of local training and
#: aggregation, the local lr, the clients left out for non-finite results, and the budget (bytes up and
#: down, local SGD steps where counted, and their running totals)
LOOP_KEYS: dict[str, Kind] = {
    "round": Kind.SCALAR, "participants": Kind.RECORD, "round_time_s": Kind.SCALAR, "lr": Kind.SCALAR,
    "nonfinite_clients": Kind.RECORD,
    **{f"{name}{suffix}": Kind.SCALAR for name in ("bytes_up", "bytes_down", "local_steps")
       for suffix in ("", "_cumulative")},
}

#: names with a meaning of their own in the sinks (module docstring) -> the kinds they may be declared
STANDARD_KINDS: dict[str, frozenset[Kind]] = {
    "loss": frozenset({Kind.PER_CLIENT, Kind.PER_CLIENT_MODEL}), "alpha": frozenset({Kind.PER_CLIENT}),
    "w": frozenset({Kind.PER_CLIENT_MODEL}), "assignment": frozenset({Kind.PER_CLIENT}),
    "effective_step": frozenset({Kind.PER_MODEL}), "model_ids": frozenset({Kind.RECORD}),
    "model_set_change": frozenset({Kind.RECORD}), "g": frozenset({Kind.SCALAR}),
}

_KINDS = ("the kinds (fedfew.algorithms.round_log): scalar, per_client (P,), per_model (K,), "
          "per_client_model (P, K), record")


class RoundLogError(ValueError):
    """A round log holds a key its method does not declare, or a declared key of the wrong shape."""


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _guess(value: Any, P: int | None, K: int | None) -> str:
    """The kinds ``value`` could be, to suggest in the error for an undeclared key (a suggestion
    only: what a key means is the method's to declare)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return "SCALAR" if is_scalar(value) else "RECORD"
    fits = [kind for kind in (Kind.PER_CLIENT, Kind.PER_MODEL, Kind.PER_CLIENT_MODEL)
            if shape_error(value, kind, P, K) is None]
    return " or Kind.".join(kind.name for kind in fits) or "RECORD"


def is_scalar(value: Any) -> bool:
    """A number: int or float (not bool), or a 0-dim tensor."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def shape_error(value: Any, kind: Kind, P: int | None, K: int | None) -> str | None:
    """Why ``value`` is not of ``kind`` for P participants and K models (None where it is; an
    unknown P or K is not checked)."""
    if kind is Kind.RECORD:
        return None
    if kind is Kind.SCALAR:
        return None if is_scalar(value) else "a number (int, float or a 0-dim tensor)"
    if not isinstance(value, torch.Tensor):
        return "a tensor"
    shape = tuple(value.shape)
    if kind is Kind.PER_CLIENT:
        ok = value.dim() in (1, 2) and (value.dim() == 1 or shape[1] == 1) and (P is None or shape[0] == P)
        return None if ok else f"one number per participant, shape (P,) or (P, 1) with P = {P}"
    if kind is Kind.PER_MODEL:
        return None if value.dim() == 1 and (K is None or shape[0] == K) else f"one number per model, shape (K,) with K = {K}"
    ok = value.dim() == 2 and (P is None or shape[0] == P) and (K is None or shape[1] == K)
    return None if ok else f"one row per participant and one column per model, shape (P, K) = ({P}, {K})"


def classify(log: Mapping[str, Any], keys: LogKeys, *, P: int | None = None, K: int | None = None,
             who: str = "the algorithm") -> dict[str, Kind]:
    """The declared kind of every key of ``log``, in the log's order, each value checked against it.

    Args:
        log: a round log (the algorithm's, or completed by the loop).
        keys: the declaration (:func:`declared`: the loop's keys and the method's).
        P: the participants of the round (default: ``len(log["participants"])`` when present);
            None leaves the per-client lengths unchecked.
        K: the server models of the round (:attr:`Algorithm.model_count`); None: the length of
            ``model_ids`` when present, else per-model lengths unchecked.
        who: the method, named in the error (e.g. ``"fedavg (FedAvg)"``).
    Raises:
        RoundLogError: a key ``keys`` does not declare, or a value not of its declared kind.
    """
    if P is None and isinstance(log.get("participants"), (list, tuple)):
        P = len(log["participants"])
    if K is None and isinstance(log.get("model_ids"), (list, tuple)):
        K = len(log["model_ids"])
    out: dict[str, Kind] = {}
    for key, value in log.items():
        kind = keys.get(key)
        if kind is None:
            raise RoundLogError(f"{who} logged {key!r} ({_describe(value)}), a key it does not declare: declare "
                                f"it in the method's log_keys beside row_shapes, e.g. {key!r}: Kind.{_guess(value, P, K)}; "
                                + _KINDS)
        kind = Kind(kind)
        allowed = STANDARD_KINDS.get(key)
        if allowed is not None and kind not in allowed:
            raise RoundLogError(f"{who} declares {key!r} {kind.value}; the sinks read {key!r} as "
                                f"{' or '.join(sorted(k.value for k in allowed))} (round_log.STANDARD_KINDS): "
                                "declare it so, or log the value under another name")
        problem = shape_error(value, kind, P, K)
        if problem is None and key == "model_ids" and K is not None:
            ok = isinstance(value, (list, tuple)) and len(value) == K and all(isinstance(i, int) for i in value)
            problem = None if ok else f"a list of the K = {K} model ids"
        if problem is not None:
            raise RoundLogError(f"{who} logged {key!r} as {_describe(value)}, but declares it {kind.value}: "
                                f"expected {problem}; fix the value in end_round or the kind in log_keys")
        out[key] = kind
    return out


def declared(algorithm: Any) -> dict[str, Kind]:
    """Every key a run's round logs may hold: the loop's (:data:`LOOP_KEYS`) and the method's
    ``log_keys`` (an algorithm instance or class)."""
    return {**LOOP_KEYS, **{k: Kind(v) for k, v in algorithm.log_keys.items()}}


def check_round_log(algorithm: Any, log: Mapping[str, Any], P: int, K: int) -> dict[str, Kind]:
    """Check what ``algorithm.end_round`` returned for P participants and K models (the round
    loop calls it before adding its own keys); returns the kinds.

    Raises:
        RoundLogError: an undeclared key (naming the method, the key and how to declare it), a key
            of the loop's own, or a value not of its declared kind.
    """
    cls = type(algorithm)
    who = f"{getattr(getattr(algorithm, 'cfg', None), 'name', cls.__name__)} ({cls.__name__}.end_round)"
    own = sorted(set(log) & set(LOOP_KEYS))
    if own:
        raise RoundLogError(f"{who} returned {own}: keys the round loop sets itself (round_log.LOOP_KEYS); rename them")
    for key, value in log.items():
        if key not in algorithm.log_keys:
            entry = f"{key!r}: Kind.{_guess(value, P, K)}"
            if "log_keys" in vars(cls):
                how = f"add {entry} to {cls.__name__}.log_keys (beside row_shapes)"
            else:
                parent = next(b.__name__ for b in cls.__mro__[1:] if "log_keys" in vars(b))
                how = f"declare log_keys = {{**{parent}.log_keys, {entry}}} in {cls.__name__}, beside row_shapes"
            raise RoundLogError(f"{who} logged {key!r} ({_describe(value)}), which {cls.__name__}.log_keys does "
                                f"not declare: {how}; {_KINDS}")
    return classify(log, algorithm.log_keys, P=P, K=K, who=who)
