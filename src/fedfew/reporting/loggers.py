"""Experiment loggers for Fabric, chosen by ``logger.name`` (none | csv | wandb).

W&B never blocks or crashes a run:

- without an API key (``WANDB_API_KEY`` or ~/.netrc) it runs offline and prints how to
  ``wandb sync`` the run later; ``logger.mode`` / ``WANDB_MODE`` override (``disabled``: no
  W&B at all);
- the run is created lazily, on rank 0 only, when the first callback uses it (so a
  multi-process run makes exactly one W&B run), with the full resolved config as run config;
- ``wandb.init`` is bounded by ``logger.init_timeout``; an online start that fails (no
  network) retries offline, and any other failure disables W&B with one warning;
- every later call is wrapped: an error disables W&B for the rest of the run with one warning;
- ``finish`` is bounded by ``logger.finish_timeout`` (W&B's own setting: unsent data stays on
  disk for ``wandb sync``).
"""
from __future__ import annotations

import csv
import io
import netrc
import os
import warnings
from pathlib import Path
from typing import Any, Callable

from lightning.fabric.loggers import Logger
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger  # the Fabric one cannot log hyperparameters
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from omegaconf import DictConfig, OmegaConf


def _none(cfg: DictConfig, run_dir: Path) -> list:
    return []


def _csv(cfg: DictConfig, run_dir: Path) -> list:
    # written every round (Lightning's default buffers 100 steps, which a stopped run would lose)
    return [RoundCSVLogger(save_dir=str(run_dir), name="logs", version="", flush_logs_every_n_steps=1)]


class _KeepingWriter(ExperimentWriter):
    """Lightning's CSV writer without its start-up deletion of ``metrics.csv``: rows are
    appended (the header rewritten when new columns appear, as Lightning does)."""

    def _check_log_dir_exists(self) -> None:  # Lightning deletes metrics.csv here
        pass

    def keep_before(self, step: int) -> int:
        """Drop the rows of ``step`` and later (the rounds after a resumed checkpoint, which run
        again); keep the others and their columns. Returns the number of rows kept."""
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return 0
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            fields, rows = list(reader.fieldnames or []), list(reader)
        keep = [r for r in rows if r.get("step") not in (None, "") and float(r["step"]) < step]
        fields = sorted(fields)  # Lightning appends rows in sorted column order
        if not keep:
            path.unlink()
            fields = []
        elif len(keep) != len(rows) or fields != list(reader.fieldnames or []):
            from fedfew.core.io import atomic_write_text

            buf = io.StringIO()
            writer = csv.DictWriter(buf, fieldnames=fields)
            writer.writeheader()
            writer.writerows(keep)
            atomic_write_text(path, buf.getvalue())
        self.metrics_keys = fields
        return len(keep)


class RoundCSVLogger(CSVLogger):
    """Lightning's CSVLogger into ``<run_dir>/logs`` (``metrics.csv``: one row per round,
    ``step`` = round; ``hparams.yaml``) that never deletes the rows of earlier rounds: a resumed
    run keeps those before its checkpoint (:meth:`start_at`) and appends its own. (Lightning's
    own deletes ``metrics.csv`` whenever the folder already holds files.)"""

    @property
    @rank_zero_experiment
    def experiment(self) -> _KeepingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingWriter(log_dir=self.log_dir)
        return self._experiment

    def start_at(self, round: int) -> int:
        """The run logs from ``round`` on: keep the rows of earlier rounds (those before a resumed
        checkpoint; none for a fresh run, ``round`` = 1). Returns the number of rows kept."""
        self.experiment.metrics = []
        return self.experiment.keep_before(int(round))


def has_wandb_credentials() -> bool:
    """True when an API key is in the environment or ~/.netrc (no network access)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(cfg: DictConfig) -> str:
    """``logger.mode`` if set (online/offline/disabled), else WANDB_MODE, else online when
    credentials exist and offline otherwise."""
    mode = cfg.get("mode") or os.environ.get("WANDB_MODE")
    if mode:
        return str(mode)
    return "online" if has_wandb_credentials() else "offline"


def _rank() -> int:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return int(getattr(rank_zero_only, "rank", 0) or 0)


class WandbLogger(Logger):
    """A Fabric logger around one W&B run (see the module docstring for its guarantees).

    Args:
        cfg: the ``logger`` config node: project, entity, group, tags, run_name, mode, dir
            (null: the run directory), init_timeout, finish_timeout.
        run_dir: the run directory (W&B writes ``<dir>/wandb/...``).
    """

    def __init__(self, cfg: DictConfig | dict, run_dir: Path) -> None:
        super().__init__()
        self.cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        self.run_dir = Path(run_dir)
        self.mode = wandb_mode(DictConfig(self.cfg))
        self._run = None
        self._failed = False
        self._finished = False
        self._config: dict[str, Any] = {}
        self.resume_id: str | None = None

    # -- Fabric's Logger interface -----------------------------------------------------------

    @property
    def name(self) -> str:
        return str(self.cfg.get("project") or "fedfew")

    @property
    def version(self) -> str | None:
        return getattr(self._run, "id", None)

    @property
    def root_dir(self) -> str:
        return str(self.save_dir)

    @property
    def save_dir(self) -> Path:
        return Path(self.cfg.get("dir") or self.run_dir)

    @property
    def experiment(self):
        """The W&B run (started on first use; ``None`` on ranks > 0, when disabled or failed)."""
        return self.start()

    def log_hyperparams(self, params: dict[str, Any] | Any, *args: Any, **kwargs: Any) -> None:
        params = OmegaConf.to_container(params, resolve=True) if isinstance(params, DictConfig) else dict(params)
        if self._run is None:
            self._config.update(params)
            self.start()
        else:
            self._call("config.update", lambda: self._run.config.update(params, allow_val_change=True))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.log(metrics, step=step)

    def finalize(self, status: str) -> None:
        """Finish the W&B run (bounded by ``finish_timeout``); prints the sync command offline.

        ``status``: ``success`` (exit code 0), ``interrupted`` (marked pre-empted, exit code 1)
        or anything else (exit code 1).
        """
        if self._run is None or self._finished:
            return
        self._finished = True
        run, self._run = self._run, None
        run_path = self._call("dir", lambda: Path(run.dir).parent)
        if status == "interrupted":  # pre-empted; the run resumes from its checkpoint
            self._call("mark_preempting", run.mark_preempting)
        self._call("finish", lambda: run.finish(exit_code=0 if status == "success" else 1))
        if self.mode == "offline" and run_path is not None:
            print(f"W&B: offline run saved; upload it with `wandb sync {run_path}`", flush=True)

    # -- fedfew's use --------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether W&B is (or can still be) in use on this rank."""
        return _rank() == 0 and not self._failed and not self._finished and self.mode != "disabled"

    def start(self, config: dict[str, Any] | None = None, run_id: str | None = None):
        """Create the W&B run on rank 0 if not done yet; returns it, or ``None``.

        Args:
            config: run config to set (added to the run when it already exists).
            run_id: resume this W&B run (a resumed fedfew run; W&B ignores resuming offline
                but keeps the id, so ``wandb sync`` files both parts under one run).
        """
        if config:
            self._config.update(config)
        if run_id and self._run is None:
            self.resume_id = str(run_id)
        if not self.active:
            return None
        if self._run is not None:
            if config:  # started earlier by another user of `experiment`: add the config now
                self._call("config.update", lambda: self._run.config.update(config, allow_val_change=True))
            return self._run
        try:
            self._run = self._init(self.mode)
        except Exception as err:
            if self.mode == "online":
                warnings.warn(f"W&B online start failed ({type(err).__name__}: {err}); logging offline instead")
                self.mode = "offline"
                try:
                    self._run = self._init("offline")
                except Exception as err2:
                    err = err2
            if self._run is None:
                self._failed = True
                warnings.warn(f"W&B disabled for this run: {type(err).__name__}: {err}")
                return None
        if self.mode == "offline":
            print(f"W&B offline: logging into {Path(self._run.dir).parent}; "
                  f"upload later with `wandb sync {Path(self._run.dir).parent}`", flush=True)
        return self._run

    def _init(self, mode: str):
        import wandb

        c = self.cfg
        self.save_dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            init_timeout=float(c.get("init_timeout") or 60), finish_timeout=float(c.get("finish_timeout") or 60),
        )
        return wandb.init(
            project=c.get("project") or "fedfew", entity=c.get("entity"), group=c.get("group"),
            tags=[str(t) for t in (c.get("tags") or [])] or None, name=c.get("run_name"),
            dir=str(self.save_dir), mode=mode, config=self._config or None, settings=settings,
            id=self.resume_id, resume="allow" if self.resume_id else None,
        )

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        """``run.log(data, step=step)``; a failure disables W&B with a warning."""
        run = self.start()
        if run is not None:
            self._call("log", lambda: run.log(data, step=step))

    def update_summary(self, values: dict[str, Any]) -> None:
        """Set values of the run summary (what the runs table shows)."""
        run = self.start()
        if run is not None:
            self._call("summary", lambda: run.summary.update(values))

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as err:  # W&B must never stop a run
            warnings.warn(f"W&B {what} failed, W&B disabled for the rest of the run: {type(err).__name__}: {err}")
            self._failed = True
            return None


def _wandb(cfg: DictConfig, run_dir: Path) -> list:
    try:
        logger = WandbLogger(cfg, run_dir)
    except Exception as err:  # W&B must never stop a run
        warnings.warn(f"W&B logger disabled: {err}")
        return []
    return [] if logger.mode == "disabled" else [logger]


LOGGERS: dict[str, Callable[[DictConfig, Path], list]] = {"none": _none, "csv": _csv, "wandb": _wandb}


def build_loggers(cfg: DictConfig, run_dir: Path) -> list:
    """Fabric loggers for ``cfg`` (the ``logger`` node).

    Raises:
        ValueError: unknown ``logger.name``.
    """
    if cfg.name not in LOGGERS:
        raise ValueError(f"logger={cfg.name!r}; allowed: {', '.join(LOGGERS)}")
    return LOGGERS[cfg.name](cfg, run_dir)
