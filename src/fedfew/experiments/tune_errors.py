"""The errors of ``make tune`` (:mod:`fedfew.experiments.tuning`)."""
from __future__ import annotations


class TuneError(RuntimeError):
    """The tune cannot run as asked (unknown algorithm, no or empty search space, bad
    overrides, a folder made by a different tune, a failed trial)."""


class TrialDiverged(Exception):
    """A trial's run went non-finite: a client's scored model, a local copy or a personal state
    (:mod:`fedfew.core.nonfinite`), or it stopped early because every client did. The trial is a failed
    trial: it counts in the budget and is never chosen. The message says which run and how."""


class TrialInterrupted(Exception):
    """A trial's run was stopped by a signal (Ctrl-C, SIGTERM, a kill), or the tune is stopping:
    the trial stays running in its study, so the next invocation repeats it from its checkpoint."""
