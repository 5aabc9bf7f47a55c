"""Run configuration: the Hydra overrides check, the value rules, presets."""
from pathlib import Path

#: conf/ (a link to the checkout's conf/ folder): Hydra's config groups and the tuned presets.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "conf"
