"""The one table of run-config keys that do not count everywhere: whether a key changes a run's
results, changes the setup a tuned preset is for, and may differ when a run resumes.

Run identity (:func:`fedfew.core.run_folders.result_overrides`: a comparison reuses and a tune
resumes across keys that do not change results), preset applicability
(:func:`fedfew.config.presets.setup_changing`) and resuming
(:func:`fedfew.core.checkpoint.check_resume_config`) all read it, so a new key is classified once.
A key not in the table counts everywhere (changes results and the setup, must match on resume).

An entry covers its key and every key under it (``trainer`` covers ``trainer.precision``); the
longest entry that covers a key decides (``trainer.threads`` over ``trainer``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeyRole:
    """How one key (and the keys under it) counts."""

    key: str                 #: dotted config key
    changes_results: bool    #: False: how or where a run is done, not its figures beyond float rounding
    changes_setup: bool      #: False: a preset tuned with another value still applies
    free_on_resume: bool     #: True: may differ between a checkpoint's run and the run that resumes it
    why: str = ""


KEYS: tuple[KeyRole, ...] = (
    KeyRole("resume", False, False, True, "which checkpoint to continue from"),
    KeyRole("resume_extend_rounds", True, True, True, "resuming with more rounds is how a run is extended"),
    KeyRole("checkpoint_every", False, False, True, "how often state is saved"),
    KeyRole("save_models", False, False, True, "whether models.pt is written"),
    KeyRole("data_dir", False, False, True, "where the data lies; what it holds is compared by content"),
    KeyRole("logger", False, False, True, "where metrics go"),
    KeyRole("trainer.threads", False, False, True, "CPU threads: the same figures up to float rounding (fedfew.core.threads)"),
    KeyRole("trainer.devices", True, False, True, "processes: results equal to one process up to float rounding"),
    KeyRole("trainer.num_nodes", True, False, True, "nodes"),
    KeyRole("trainer.strategy", True, False, True, "how processes talk"),
    KeyRole("dataset.cache", True, True, True, "where prepared data is cached"),
    KeyRole("dataset.in_memory", True, True, True, "whether data is held in memory"),
    KeyRole("dataset.rounds", True, True, True, "the dataset's round budget"),
    KeyRole("collapse", True, False, True, "the collapse watch only warns"),
    KeyRole("fail_on_nonfinite", False, False, True, "stop or go on when a client goes non-finite"),
    KeyRole("hydra", False, False, True, "Hydra's own settings, the run folder"),
    KeyRole("trainer", True, False, False, "accelerator and precision: the same tuned values apply"),
    KeyRole("engine", True, False, False, "how clients are batched: the same updates"),
    KeyRole("engine_clients", True, False, False, "clients per engine chunk"),
    KeyRole("compile", True, False, False, "torch.compile"),
    KeyRole("eval_every", True, False, False, "how often clients are scored"),
)


def role(key: str) -> KeyRole | None:
    """The table entry that decides for dotted ``key`` (the longest that covers it), or None."""
    covering = [r for r in KEYS if key == r.key or key.startswith(r.key + ".")]
    return max(covering, key=lambda r: len(r.key), default=None)


def changes_results(key: str) -> bool:
    """Whether ``key`` changes what a run computes (True for a key outside the table)."""
    found = role(key)
    return found is None or found.changes_results


def changes_setup(key: str) -> bool:
    """Whether ``key`` changes the setup a preset is tuned for (True for a key outside the table)."""
    found = role(key)
    return found is None or found.changes_setup


def free_on_resume(key: str) -> bool:
    """Whether ``key`` may differ when a run resumes (False for a key outside the table)."""
    found = role(key)
    return found is not None and found.free_on_resume


#: the keys that may differ on resume, as the resume error lists them
RESUME_FREE_KEYS = tuple(r.key for r in KEYS if r.free_on_resume)
#: the keys that do not change results (run identity)
RESULT_NEUTRAL = tuple(r.key for r in KEYS if not r.changes_results)
#: the keys that do not change the setup of a preset
SETUP_NEUTRAL = tuple(r.key for r in KEYS if not r.changes_setup)
