"""The one non-finite policy of a run: what happens when a client's loss, update, local copy or
personal state is NaN or inf.

Every place that finds one calls :meth:`NonFiniteLog.report` (the algorithms' client steps through
``ctx.nonfinite``, :meth:`fedfew.algorithms.base.Algorithm.save_client` for personal state). With
``fail_on_nonfinite=true`` the report raises ``FloatingPointError`` at once; otherwise it is
recorded, the algorithm leaves that client's contribution out of the round's aggregation, and
the run goes on. Nothing is printed per round: at the end of the run one line says which clients
went non-finite, in what, from which round and for how many rounds (:meth:`NonFiniteLog.line`),
and results.json holds the same as data (``nonfinite``, :meth:`NonFiniteLog.as_dict`).

A round in which *every* participant reported a non-finite result sent nothing finite to the
server. After :data:`DIVERGED_ROUNDS` such rounds in a row the run has diverged: the round loop
stops early (the server models are what they were before), the final evaluation is still
written, results.json's summary carries ``verdict: "diverged"`` and ``python -m fedfew.train``
exits with :data:`DIVERGED_EXIT` (``make compare`` and ``make tune`` report it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: rounds in a row in which every participant was non-finite before a run counts as diverged
#: (one such round can be a spike that the next round's fresh start from the server models
#: survives; three in a row with the server models unchanged cannot recover)
DIVERGED_ROUNDS = 3
#: exit code of ``python -m fedfew.train`` for a run that stopped because it diverged
DIVERGED_EXIT = 3
#: results.json ``summary.verdict`` values: every report finite | some clients non-finite in some
#: rounds, run finished | stopped early, nothing finite reached the server
VERDICTS = ("finite", "nonfinite", "diverged")


@dataclass
class ClientRecord:
    """What went non-finite for one client: its first and last round, the number of rounds with
    a report, and each distinct thing reported (e.g. ``local copy of model 2``, ``personal state 'head'``)."""

    first_round: int
    last_round: int
    rounds: int = 1
    what: list[str] = field(default_factory=list)


class NonFiniteLog:
    """Non-finite reports of one run (this process's clients; the round loop combines the ranks).

    Args:
        fatal: ``fail_on_nonfinite``: raise at the first report instead of recording it.
    """

    def __init__(self, fatal: bool = False) -> None:
        self.fatal = bool(fatal)
        self.round = 0
        self.clients: dict[int, ClientRecord] = {}
        self._this_round: set[int] = set()
        #: rounds in which every participant reported, and the current streak of them
        self.diverged_rounds: list[int] = []
        self.streak = 0
        self.stopped_at: int | None = None

    def begin_round(self, rnd: int) -> None:
        """Start collecting the reports of round ``rnd``."""
        self.round = int(rnd)
        self._this_round = set()

    def report(self, client_id: int, what: str) -> None:
        """Client ``client_id``'s ``what`` is not finite in the current round.

        Raises:
            FloatingPointError: with ``fatal`` (``fail_on_nonfinite=true``), naming the round,
                the client and what.
        """
        cid = int(client_id)
        if self.fatal:
            raise FloatingPointError(f"round {self.round}: client {cid}: non-finite {what} (fail_on_nonfinite=true; "
                                     "a lower optim.lr or optim.clip_norm usually cures it)")
        record = self.clients.get(cid)
        if record is None:
            record = self.clients[cid] = ClientRecord(self.round, self.round)
        elif cid not in self._this_round:
            record.rounds += 1
            record.last_round = self.round
        if what not in record.what:
            record.what.append(what)
        self._this_round.add(cid)

    def reported_this_round(self) -> set[int]:
        """Clients of this process with a report in the current round."""
        return set(self._this_round)

    def end_round(self, participants: list[int], reported: set[int]) -> bool:
        """Close the round; ``reported``: the clients with a report this round on every rank.
        Returns whether the run has now diverged (:data:`DIVERGED_ROUNDS` rounds in a row in which
        every participant reported)."""
        if participants and set(participants) <= set(reported):
            self.diverged_rounds.append(self.round)
            self.streak += 1
        else:
            self.streak = 0
        if self.streak >= DIVERGED_ROUNDS and self.stopped_at is None:
            self.stopped_at = self.round
        return self.stopped_at is not None

    @property
    def verdict(self) -> str:
        """One of :data:`VERDICTS`."""
        if self.stopped_at is not None:
            return "diverged"
        return "nonfinite" if self.clients else "finite"

    def as_dict(self) -> dict[str, Any]:
        """results.json ``nonfinite``: ``clients`` (id -> first_round, last_round, rounds, what),
        ``diverged_rounds`` (rounds where every participant was non-finite), ``stopped_at``
        (the round the run stopped after, or None) and ``verdict``."""
        return {"clients": {str(c): vars(r).copy() for c, r in sorted(self.clients.items())},
                "diverged_rounds": list(self.diverged_rounds), "stopped_at": self.stopped_at, "verdict": self.verdict}

    def state_dict(self) -> dict[str, Any]:
        return {**self.as_dict(), "streak": self.streak}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None: a checkpoint from before this log: nothing recorded)."""
        state = state or {}
        self.clients = {int(c): ClientRecord(**r) for c, r in state.get("clients", {}).items()}
        self.diverged_rounds = list(state.get("diverged_rounds", []))
        self.streak = int(state.get("streak", 0))
        self.stopped_at = state.get("stopped_at")


#: clients listed by name in the console line; the rest are counted (results.json lists all)
LISTED_CLIENTS = 6


def _what(items: list[str]) -> str:
    """``["local copy of model 0", "local copy of model 2", "personal state 'head'"]`` ->
    ``"local copies of models 0, 2, personal state 'head'"``."""
    prefix = "local copy of model "
    models = sorted(int(i[len(prefix):]) for i in items if i.startswith(prefix))
    rest = [i for i in items if not i.startswith(prefix)]
    head = ([] if not models else [f"{prefix}{models[0]}"] if len(models) == 1 else
            [f"local copies of models {', '.join(map(str, models))}"])
    return ", ".join(head + rest)


def describe(record: dict[str, Any] | None, rounds: int) -> str | None:
    """The console's one line for results.json's ``nonfinite`` (:meth:`NonFiniteLog.as_dict`);
    None when everything stayed finite (or the run predates the log), e.g. ``non-finite in 1 of
    the clients, left out of those rounds' aggregation: client 3: local copy of model 2, rounds
    42-56 (12 rounds). ...``; a diverged run's line starts with ``DIVERGED``."""
    if not record or not (record.get("clients") or record.get("stopped_at") is not None):
        return None
    clients = sorted(record.get("clients", {}).items(), key=lambda kv: int(kv[0]))
    parts = []
    for cid, r in clients[:LISTED_CLIENTS]:
        first, last, n = r["first_round"], r["last_round"], r["rounds"]
        span = f"round {first}" if first == last else f"rounds {first}-{last}"
        parts.append(f"client {cid}: {_what(r['what'])}, {span} ({n} round{'s' if n != 1 else ''})")
    if len(clients) > LISTED_CLIENTS:
        parts.append(f"{len(clients) - LISTED_CLIENTS} more clients (results.json nonfinite)")
    if record.get("stopped_at") is not None:
        return (f"DIVERGED: every participant was non-finite in rounds {record['diverged_rounds'][-DIVERGED_ROUNDS:]}, "
                f"so the run stopped after round {record['stopped_at']} of {rounds} (exit code {DIVERGED_EXIT}); the "
                f"figures below are of the models as they were then, not a result. {len(clients)} client(s) non-finite: "
                + "; ".join(parts) + ". A lower optim.lr or an optim.clip_norm usually cures it")
    return (f"non-finite in {len(clients)} client(s), left out of those rounds' aggregation: " + "; ".join(parts)
            + ". A lower optim.lr or an optim.clip_norm usually cures it")
