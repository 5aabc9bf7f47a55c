"""Search spaces of ``make tune``: ``conf/tune/common.yaml`` plus ``conf/tune/<algorithm>.yaml``, one
:class:`Dimension` per key (log-uniform, uniform, integer or a choice)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfew.config import CONFIG_DIR
from fedfew.experiments.tune_errors import TuneError

#: one search-space file per algorithm, plus common.yaml (the local lr, for every method)
SPACE_DIR = CONFIG_DIR / "tune"


@dataclass(frozen=True)
class Dimension:
    """One searched key.

    Attributes:
        key: dotted config key (``optim.lr``, ``algorithm.mu``).
        low, high: bounds (inclusive); for ``scale``, multiples of that config value.
        log: sample log-uniformly (low > 0).
        kind: ``float`` | ``int`` | ``categorical``.
        choices: the options of a categorical key.
        scale: a config key whose value multiplies low and high (``dataset.lr``), or None.
    """

    key: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    kind: str = "float"
    choices: tuple = ()
    scale: str | None = None

    @classmethod
    def parse(cls, key: str, spec: Any, source: Path) -> "Dimension":
        """From one entry of a space file (``key: {low, high, log, type, scale}`` or
        ``key: {choices: [...]}``).

        Raises:
            TuneError: a malformed entry (named with its file).
        """
        where = f"{source}: {key}"
        if not isinstance(spec, dict):
            raise TuneError(f"{where}: expected a mapping {{low, high[, log, type, scale]}} or {{choices: [...]}}, "
                            f"got {spec!r}")
        unknown = set(spec) - {"low", "high", "log", "type", "scale", "choices"}
        if unknown:
            raise TuneError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: low, high, log, type, scale, choices")
        if "choices" in spec:
            choices = tuple(spec["choices"] or ())
            if len(choices) < 2:
                raise TuneError(f"{where}: choices needs at least two options, got {list(choices)}")
            return cls(key, kind="categorical", choices=choices)
        kind = str(spec.get("type", "float"))
        if kind not in ("float", "int"):
            raise TuneError(f"{where}: type={kind!r}; allowed: float, int (or choices: [...])")
        try:
            low, high = float(spec["low"]), float(spec["high"])
        except (KeyError, TypeError, ValueError):
            raise TuneError(f"{where}: needs numeric low and high, got {spec!r}") from None
        log = bool(spec.get("log", False))
        if not (math.isfinite(low) and math.isfinite(high) and low < high) or (log and low <= 0):
            raise TuneError(f"{where}: needs low < high (and low > 0 with log: true), got low={low}, high={high}")
        return cls(key, low, high, log, kind, (), spec.get("scale"))

    def resolve(self, cfg) -> "Dimension":
        """Bounds in the run's units: ``scale``'s value (from the composed ``cfg``) times
        low and high.

        Raises:
            TuneError: the key or the scale key is not in the config.
        """
        from omegaconf import OmegaConf

        if OmegaConf.select(cfg, self.key, default=_MISSING) is _MISSING:
            raise TuneError(f"search space key {self.key} is not in the config of algorithm "
                            f"{cfg.algorithm.name}; fix conf/tune/{cfg.algorithm.name}.yaml")
        if self.scale is None:
            return self
        factor = OmegaConf.select(cfg, self.scale, default=_MISSING)
        if factor is _MISSING or not isinstance(factor, (int, float)) or factor <= 0:
            raise TuneError(f"search space {self.key}: scale {self.scale} is not a positive number in the config "
                            f"({factor!r})")
        return Dimension(self.key, self.low * factor, self.high * factor, self.log, self.kind, self.choices, None)

    def suggest(self, trial) -> Any:
        """The value of this key for an Optuna trial: floats rounded to 3 significant digits
        (the run gets exactly the value the preset will hold), ints exact."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log)
        return float(f"{trial.suggest_float(self.key, self.low, self.high, log=self.log):.3g}")

    def position(self, value: Any) -> float | None:
        """Where ``value`` lies in [low, high]: 0 at low, 1 at high, on the log scale for a log
        key (outside the range: below 0 or above 1, -inf for a value <= 0 on a log key); None for a
        categorical key or a value that is not a number (a config default such as apfl's
        ``alpha_lr: null``)."""
        if self.kind == "categorical" or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if self.log:
            return math.log(value / self.low) / math.log(self.high / self.low) if value > 0 else -math.inf
        return (value - self.low) / (self.high - self.low)

    def describe(self) -> str:
        if self.kind == "categorical":
            return f"{self.key} in {list(self.choices)}"
        shape = ("log-uniform" if self.log else "uniform") + (" integer" if self.kind == "int" else "")
        scale = f" x {self.scale}" if self.scale else ""
        return f"{self.key} {shape} [{self.low:.4g}, {self.high:.4g}]{scale}"


_MISSING = object()


def load_space(algorithm: str, space_dir: Path | None = None) -> list[Dimension]:
    """The search space of ``algorithm``: ``common.yaml`` (every method) then
    ``<algorithm>.yaml`` (its own keys), unresolved.

    Raises:
        TuneError: no file for the algorithm, or a malformed one.
    """
    import yaml

    space_dir = SPACE_DIR if space_dir is None else Path(space_dir)
    dims: list[Dimension] = []
    for path in (space_dir / "common.yaml", space_dir / f"{algorithm}.yaml"):
        if not path.exists():
            raise TuneError(f"no search space for algorithm {algorithm}: {path} is missing; add it with the method's "
                            "own keys ({} to tune the local lr only; docs/tuning.md)")
        content = yaml.safe_load(path.read_text()) or {}
        if not isinstance(content, dict):
            raise TuneError(f"{path}: expected a mapping of dotted keys to ranges, got {type(content).__name__}")
        dims += [Dimension.parse(str(k), v, path) for k, v in content.items()]
    return dims
