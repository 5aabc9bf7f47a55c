"""Collapse you can see: a warning when one of an algorithm's server models stops serving clients.

Few-for-many methods (FedFew, IFCA, FedSoft) keep K server models so that groups of clients
get their own; when one model stops moving, or no client picks it, the run silently becomes a
(K-1)-model run. :class:`CollapseWatch` (a Fabric callback, rank 0) prints one warning per model
and cause:

- **starved**: the model's effective step (``effective_step`` in the round logs: the fraction of
  a client-sized step it took) stayed below ``collapse.step`` for ``collapse.rounds`` rounds in a
  row;
- **unserved**: no client is assigned to it (``models_served``) at an evaluation.

Each warning names the keys that help (the algorithm's ``collapse_keys``, :class:`Hint`; only
those the run has not already set to the recommended value: :func:`collapse_advice`), then the
algorithm's ``collapse_hint`` text, and is kept in the run's ``summary.collapse_warnings``
(results.json). Algorithms opt in with ``watch_collapse``.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fedfew.simulator.run_view import RunView


def collapse_advice(algorithm, cfg) -> str:
    """What a collapse warning advises a run with config ``cfg``: "Keys that help: ..." with the
    algorithm's ``collapse_keys`` the run has not already set (:meth:`Hint.needed`), then its
    ``collapse_hint`` text; "" when there is neither."""
    hints = [str(h) for h in getattr(algorithm, "collapse_keys", ()) if h.needed(cfg)]
    parts = [f"Keys that help: {', '.join(hints)}."] if hints else []
    parts.append(str(getattr(algorithm, "collapse_hint", "")))
    return " ".join(p for p in parts if p)


class CollapseWatch:
    """Tracks starved and unserved server models (see module docstring).

    Args (from the run config ``collapse`` node, read at fit start):
        step: effective-step threshold (default 0.01).
        rounds: consecutive rounds below it before warning (default 10).
    """

    def __init__(self) -> None:
        self.enabled = False
        self.step, self.rounds = 0.01, 10
        self.below: list[int] = []
        self.warned: set[tuple[int, str]] = set()
        self.messages: list[str] = []
        self.hint = ""
        self.rank0 = True

    def on_fit_start(self, sim: RunView) -> None:
        alg = sim.algorithm
        self.rank0 = sim.rank == 0
        self.enabled = bool(getattr(alg, "watch_collapse", False)) and sim.module.K > 1
        cfg = sim.cfg.get("collapse") or {}
        self.step = float(cfg.get("step", 0.01))
        self.rounds = int(cfg.get("rounds", 10))
        self.hint = collapse_advice(alg, sim.cfg)
        self.below = [0] * sim.module.K

    def check(self, round: int, effective_step: torch.Tensor | None, served: list[int] | None) -> list[str]:
        """Update the counters with one round; returns the new warnings (each at most once).

        Args:
            round: the round (1-based).
            effective_step: (K,) effective step of each model this round, or None.
            served: clients per model at this round's evaluation, or None (no evaluation).
        """
        new = []
        if effective_step is not None:
            for k, value in enumerate(effective_step.tolist()):
                self.below[k] = self.below[k] + 1 if value < self.step else 0
                if self.below[k] >= self.rounds and (k, "starved") not in self.warned:
                    self.warned.add((k, "starved"))
                    new.append(f"round {round}: model {k} has taken less than {self.step:g} of a client step for "
                               f"{self.rounds} rounds in a row (effective step {value:.3g}): it no longer learns")
        for k, count in enumerate(served or []):
            if count == 0 and (k, "unserved") not in self.warned:
                self.warned.add((k, "unserved"))
                new.append(f"round {round}: no client selects model {k} "
                           f"(clients per model {list(served)}): only {sum(1 for c in served if c)} of "
                           f"{len(served)} models serve clients")
        return new

    def on_round_end(self, sim: RunView, round: int, logs: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
        if not self.enabled:
            return
        step = logs.get("effective_step")
        served = evaluation["summary"].get("models_served") if evaluation is not None else None
        for message in self.check(round, step if isinstance(step, torch.Tensor) else None, served):
            self.messages.append(message)
            if self.rank0:
                print(f"warning: {message}. {self.hint}".rstrip(), file=sys.stderr, flush=True)

    def on_fit_end(self, sim: RunView, results: dict[str, Any]) -> None:
        if self.enabled:
            for scored in [results, *(results.get("also") or {}).values()]:  # eval.also: the same training
                scored["summary"]["collapse_warnings"] = list(self.messages)
