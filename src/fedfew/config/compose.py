"""The one place a run config is composed outside ``python -m fedfew.train`` (Hydra's compose API)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from fedfew.config import CONFIG_DIR


class ComposeError(ValueError):
    """Hydra could not compose the config (unknown group option, malformed override, ...)."""


def compose(overrides: Sequence[str], config_dir: str | Path = CONFIG_DIR):
    """The run config that ``python -m fedfew.train <overrides>`` would get; no run folder is made.

    Hydra's global state is restored afterwards, so this may be called while a Hydra app runs.

    Args:
        overrides: Hydra overrides, e.g. ``["dataset=agnews", "algorithm.K=5"]``.
        config_dir: the config folder (default: the package's ``conf/``).

    Returns:
        The composed ``DictConfig`` (interpolations unresolved).

    Raises:
        ComposeError: Hydra cannot compose it; the message is Hydra's.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(overrides))
    except HydraException as err:  # ConfigCompositionException, OverrideParseException, ...
        raise ComposeError(str(err)) from err
    finally:
        restore_gh_from_backup(backup)
