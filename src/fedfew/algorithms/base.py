"""The interface every federated algorithm implements (FedFew and the baselines).

A round, as driven by :mod:`fedfew.simulator.simulation`::

    alg.begin_round(round, participants)
    rows = alg.train_clients(this rank's participants, round)   # rows keyed by client id
    gathered = gather rows of all ranks (participants x ...), in client order
    K = alg.model_count                                           # the server models of this round
    logs = alg.end_round(round, participants, gathered)          # checked against alg.log_keys

and at evaluation time each client is scored with ``alg.candidates(client)``: the model(s) it
may use; the one with the lowest eval-mode loss on the client's selection split is chosen.

The hooks a method fills in, and nothing else:

- ``num_models(cfg)``: how many server models it keeps (FedFew, IFCA: K; the others: 1);
- ``client_update``: what a client does with the broadcast state (its local training);
  ``train_clients`` runs it over the round's cohort, one client at a time, unless a method
  trains several clients at once (FedFew's engines override it);
- ``end_round``: how the server aggregates what the clients sent; it returns the round log,
  every key of which the method declares in ``log_keys`` with its kind
  (:mod:`fedfew.algorithms.round_log`: scalar, per_client, per_model, per_client_model, record);
- ``candidates``: which model(s) a client is scored with;
- ``model_assignment``: which server model a client counts as served by (default: its pick);
- per-client state that persists between rounds (personal heads, personal models) goes
  through :meth:`Algorithm.save_client` / :meth:`Algorithm.load_client`, which keep it on
  the host (``ctx.host_state``), never on the device;
- ``communication(cfg, model)``: numbers sent per participating client per round (the state
  vector entries that travel: parameters and, where they are aggregated, BatchNorm statistics).

BatchNorm (docs/models.md): what is averaged, sent and kept per client is a model's *state
vector* (:func:`fedfew.core.model_set.flat_state`: parameters, then BatchNorm running statistics and
counters), so the server's statistics are the clients' statistics combined with the same weights
as the parameters, and personal models keep their own statistics.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from omegaconf import OmegaConf
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit, FederatedData
from fedfew.core.allowed import check_value
from fedfew.core.model_set import KModelSet, state_numel
from fedfew.core.nonfinite import NonFiniteLog

if TYPE_CHECKING:  # Lightning's import takes ~3 s (torchmetrics, transformers): a Flower client never needs it
    from lightning.fabric import Fabric


@dataclass(frozen=True)
class Hint:
    """A config change that may help a collapsed run, named in the warning.

    key: the dotted run-config key (``algorithm.normalize``); value: the recommended value, or
    None for a change in a direction, said by ``change`` (``"a larger"``); why: what it does
    (optional). A hint with a value is left out of a run that already has that value.
    """

    key: str
    value: Any = None
    why: str = ""
    change: str = ""

    def needed(self, cfg) -> bool:
        """Whether the hint tells ``cfg``'s run something: it is a change in a direction, or the
        run's value of ``key`` is not the recommended one."""
        return self.value is None or OmegaConf.select(cfg, self.key, default=None) != self.value

    def __str__(self) -> str:
        value = str(self.value).lower() if isinstance(self.value, bool) else self.value
        head = f"{self.change} {self.key}" if self.value is None else f"{self.key}={value}"
        return f"{head} ({self.why})" if self.why else head


@dataclass
class Context:
    """What an algorithm may use.

    Attributes:
        cfg: the full resolved run config.
        fabric: the Lightning Fabric (device, precision, rank).
        data: pooled tensors on ``fabric.device``.
        module: the K-model set (server models + working copy) on the device.
        train_index: per client, (n_train,) int64 indices on the device.
        num_train: (M,) int64 train sizes n_i (host).
        autocast: Fabric's autocast context-manager factory.
        host_state: per-client persistent state kept on the host (client id -> dict).
        nonfinite: the run's one non-finite policy (:mod:`fedfew.core.nonfinite`): every non-finite
            loss, update or personal state is reported there (default: from ``fail_on_nonfinite``).
    """

    cfg: DictConfig
    fabric: Fabric
    data: FederatedData
    module: KModelSet
    train_index: list[torch.Tensor]
    num_train: torch.Tensor
    autocast: Callable[[], Any] | None = None
    host_state: dict[int, dict[str, Any]] = field(default_factory=dict)
    nonfinite: NonFiniteLog | None = None

    def __post_init__(self) -> None:
        if self.nonfinite is None:
            self.nonfinite = NonFiniteLog(fatal=bool(self.cfg.get("fail_on_nonfinite", False)))

    def finite_or_reported(self, client_id: int, tensor: torch.Tensor, what: str) -> bool:
        """True when ``tensor`` is finite; otherwise report it (:meth:`NonFiniteLog.report`:
        raises ``FloatingPointError`` under ``fail_on_nonfinite``) and return False, and the
        caller leaves the client's contribution out of this round."""
        if bool(torch.isfinite(tensor).all()):
            return True
        self.nonfinite.report(client_id, what)
        return False


class Algorithm:
    """Base class. Subclasses set ``num_models`` from their config and implement the hooks.

    Args:
        cfg: the ``algorithm`` config node.
        ctx: the :class:`Context`.
    """

    #: rows that :meth:`client_update` returns, name -> shape of one row given K
    row_shapes: dict[str, Callable[[int], tuple[int, ...]]] = {}
    #: every key :meth:`end_round` may return -> its kind (:mod:`fedfew.algorithms.round_log`); the
    #: sinks write each key by its kind, and the round loop stops the run on an undeclared key or a
    #: value of the wrong shape. A subclass extends its parent's: ``{**Parent.log_keys, "x": Kind.SCALAR}``.
    #: Every method logs ``loss``, its participants' training losses: one per server model each one
    #: trained, (P, K); a method whose clients train one model each declares it per_client, (P, 1)
    log_keys: dict[str, Kind] = {"loss": Kind.PER_CLIENT_MODEL}
    #: the method's own keys (conf/algorithm/<name>.yaml) -> their allowed values in words, e.g.
    #: ``{"lam": "number >= 0"}``: :func:`fedfew.core.allowed.check_of` turns each into the check
    #: validation runs before any data is read, the constructor runs it again (so a method built
    #: directly gets the same error), and the docs table lists it (a literal: read from the source,
    #: no import). A constructor checks only what the text cannot state (a bound that depends on K).
    key_rules: dict[str, str] = {}

    #: whether :class:`fedfew.reporting.collapse_watch.CollapseWatch` warns when a server model stops
    #: serving clients (few-for-many methods); the keys that help (:class:`Hint`,
    #: each named only where the run has not already set it) and a text after them, in the warning
    watch_collapse: bool = False
    collapse_keys: tuple[Hint, ...] = ()
    collapse_hint: str = ""

    #: whether local training goes through an engine (top-level ``engine``, ``compile``;
    #: :mod:`fedfew.engines`): FedFew and its reference config. Any other method trains with its own
    #: loop, so ``engine=vmap`` is refused for it (:func:`fedfew.config.rules.validate_config`, which reads
    #: this literal from the source without importing the module: :func:`fedfew.core.registry.declared`)
    uses_engine: bool = False

    def __init__(self, cfg: DictConfig, ctx: Context) -> None:
        """Raises:
            ValueError: a declared key's value outside its :attr:`key_rules` text (the same
                ``algorithm.<key>=<value>: allowed <text>`` as the config validation).
        """
        for key in type(self).key_rules:
            if key in cfg:
                self.option(cfg, key)
        self.cfg = cfg
        self.ctx = ctx

    @classmethod
    def option(cls, cfg: DictConfig, key: str) -> Any:
        """``cfg[key]``, checked against its :attr:`key_rules` text (for code that runs before the
        constructor, e.g. :meth:`num_models`).

        Raises:
            ValueError: ``algorithm.<key>=<value>: allowed <text>``.
        """
        check_value(f"algorithm.{key}", cfg[key], cls.key_rules[key])
        return cfg[key]

    @staticmethod
    def num_models(cfg: DictConfig) -> int:
        """How many server models the algorithm keeps (FedFew: K)."""
        return 1

    @property
    def model_count(self) -> int:
        """The server models of the round about to end: the K of its per-model and
        per-client-model log values and of its communication. The round loop reads it before
        :meth:`end_round`, which may retire a model (FedFew's ``K=auto``). Default: the models the
        module holds."""
        return int(self.ctx.module.K)

    def begin_round(self, rnd: int, participants: list[int]) -> None:
        """Called on every rank before local training; ``participants`` are client ids."""

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        """Local work of one client from the broadcast server state; returns its rows."""
        raise NotImplementedError

    def train_clients(self, clients: list[ClientSplit], rnd: int) -> dict[int, dict[str, torch.Tensor]]:
        """Local work of a cohort: the participants of round ``rnd`` this process trains, in round
        order; returns each one's rows (:meth:`client_update`'s), by client id.

        The round loop calls this, not :meth:`client_update`. The default trains one client at a
        time; a method that trains several clients at once overrides it (FedFew's engines).
        """
        return {client.id: self.client_update(client, rnd) for client in clients}

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Server aggregation on every rank (identical result everywhere); returns the round log,
        whose keys :attr:`log_keys` declares.

        ``rows[name]`` has shape (len(participants), ...) in the order of ``participants``.
        """
        raise NotImplementedError

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        """Models client ``client`` may be scored with (default: every server model)."""
        return list(self.ctx.module.models)

    def model_assignment(self, client: ClientSplit, chosen: int) -> int:
        """The server model client ``client`` is assigned to, given the index ``chosen`` of the
        candidate it picked at evaluation (default: that index, i.e. k_i* when the candidates are
        the server models). Methods scored with one model of their own override it (CFL: the
        client's cluster; FedSoft: its largest importance weight). Used for ``models_served``
        and ``assignment_ari``."""
        return int(chosen)

    @classmethod
    def communication(cls, cfg: DictConfig, model: nn.Module) -> tuple[int, int]:
        """Numbers (up, down) one participating client sends and receives per round: entries of
        the state vectors that travel (:func:`fedfew.core.model_set.state_numel`: parameters, plus the
        BatchNorm running statistics and counters where they are aggregated).

        Default: all ``num_models(cfg)`` server models both ways (FedFew: K x D up and down, with
        D = d for a model without BatchNorm).

        Args:
            cfg: the ``algorithm`` config node.
            model: one freshly built model of the run's architecture (for D and body/head sizes).
        """
        D = state_numel(model)
        return cls.num_models(cfg) * D, cls.num_models(cfg) * D

    # -- per-client state on the host -------------------------------------------------------

    def save_client(self, client_id: int, **tensors: torch.Tensor) -> None:
        """Keep ``tensors`` for client ``client_id`` between rounds, as detached CPU copies. A
        non-finite one (a diverged personal model, head, APFL's v_i) is reported to
        ``ctx.nonfinite`` (under ``fail_on_nonfinite`` that stops the run) and kept as it is.

        Raises:
            FloatingPointError: a non-finite tensor under ``fail_on_nonfinite=true``.
        """
        slot = self.ctx.host_state.setdefault(int(client_id), {})
        for name, value in tensors.items():
            if value.is_floating_point():
                self.ctx.finite_or_reported(client_id, value, f"personal state '{name}'")
            slot[name] = value.detach().to("cpu", copy=True)

    def load_client(self, client_id: int, name: str) -> torch.Tensor | None:
        """Client ``client_id``'s saved tensor ``name`` on the training device (None if never saved)."""
        value = self.ctx.host_state.get(int(client_id), {}).get(name)
        return None if value is None else value.to(self.ctx.fabric.device)

    def summary(self) -> dict[str, Any]:
        """Entries the algorithm adds to the run's final summary (results.json), e.g. FedFew's
        ``K_changes`` under ``K=auto``; default none."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Server-side state beyond the K models and ``ctx.host_state`` (for checkpoints)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
