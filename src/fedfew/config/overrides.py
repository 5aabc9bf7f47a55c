"""Command-line keys that would change nothing: our own error, before Hydra's and before any compute.

Hydra answers an unknown key without a prefix (``mu=-1``) with "To append to your config use
+mu=-1", and a run started that way trains with the key silently ignored; so does any
``+<key>=...`` that no config defines (a typo such as ``+algorithm.mu_prox=0.1`` with
``algorithm=fedfew``). :func:`check_overrides` composes the config with the command line's
group choices only (``dataset=``, ``algorithm=``, ...; every combination of a multirun's group
sweeps) and rejects every key override, with or without ``+``, whose key is not in it, naming
the closest valid key (:mod:`difflib` on the dotted key and on its last part, so ``mu`` ->
``algorithm.mu``) and the options of the group that do define it.

A key that exists but that the chosen settings ignore is refused the same way: the config is
composed with every override, and an override of a key whose rules in :mod:`fedfew.config.rules` apply
to none of the chosen settings (:func:`fedfew.config.rules.ignored_key`) is named with the choices
that use it, e.g. ``partition.alpha=0`` on the clustered split with ``within=iid``: the run would
train with the key ignored, and its value (invalid here) would never be checked.

Escape, for a key that a user really means to add: ``++key=value`` (Hydra's force-add: add the
key, or set it where it exists; neither check applies to it). fedfew reads only the keys its
configs define, so such a key is recorded in the run's config but changes nothing unless code
reads it; ``make compare`` uses ``++algorithm.K=5`` this way to give every method the same
override.

A group choice that does not exist (``algorithm=fedavgg``) is named with the closest options
(:func:`fedfew.core.registry.unknown_name`: "did you mean fedavg?"), where Hydra lists them all
without a hint. Overrides of ``hydra.*``, deletions (``~key``) and nested group options
(``tuned=<folder>/<preset>``) are left to Hydra, whose messages for those are accurate.
:func:`main_check` is what ``python -m fedfew.train`` runs on its arguments before Hydra starts.
"""
from __future__ import annotations

import difflib
import itertools
import sys
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf

#: the configs of ``python -m fedfew.train`` (conf/, linked into the package)
from fedfew.config import CONFIG_DIR

#: a suggestion scoring below this (see :func:`closest_key`) is called "nearest", not "closest"
SIMILAR = 0.6
#: at most this many combinations of swept groups (and swept keys) are composed (beyond: no check)
MAX_COMBINATIONS = 32


class OverrideError(ValueError):
    """Command-line overrides that :func:`check_overrides` refuses (before Hydra and any compute)."""


class UnknownKeyError(OverrideError):
    """Command-line keys that no config defines; the message names each and its closest valid key
    (and, after them, any key the chosen settings ignore)."""


class UnknownChoiceError(OverrideError):
    """Command-line group choices that do not exist (``algorithm=fedavgg``); the message names the
    closest options and lists them all."""


class IgnoredKeyError(OverrideError):
    """Command-line keys that exist but that the chosen settings ignore; the message names each and
    the choices that use it."""


def config_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a leaf of ``cfg`` (a value, not a section; ``hydra`` excluded), unresolved."""
    out: list[str] = []
    for key in cfg.keys():
        if not prefix and key == "hydra":
            continue
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_interpolation():
            out += config_keys(node, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def has_key(cfg: Any, key: str) -> bool:
    """Whether the dotted ``key`` exists in ``cfg`` (without resolving interpolations)."""
    node = cfg
    for part in key.split("."):
        if isinstance(node, DictConfig) and part in node:
            node = node._get_node(part)
        elif isinstance(node, ListConfig) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node._get_node(int(part))
        else:
            return False
    return True


def closest_key(key: str, candidates: Iterable[str]) -> tuple[str | None, float]:
    """The candidate most like ``key`` and its score in [0, 1], comparing last parts (what a
    user misspells or leaves out: ``mu`` -> ``algorithm.mu``): an equal last part scores 1; a
    last part that is one of the other's ``_``-separated words 0.8 (``mu_prox`` -> ``mu``);
    else :class:`difflib.SequenceMatcher`'s ratio (``round`` -> ``rounds``: 0.91). Ties go to a
    candidate in the same section, then to the shorter key. ``(None, 0.0)`` without candidates.
    """
    parent, _, last = key.lower().rpartition(".")
    words = set(last.split("_"))
    best, best_rank = None, (-1.0, False, 0)
    for cand in candidates:
        cand_parent, _, cand_last = cand.lower().rpartition(".")
        if cand_last == last:
            score = 1.0
        elif cand_last in words or last in set(cand_last.split("_")):
            score = 0.8
        else:
            score = difflib.SequenceMatcher(None, last, cand_last).ratio()
        rank = (score, cand_parent == parent, -len(cand))
        if rank > best_rank:
            best, best_rank = cand, rank
    return best, max(best_rank[0], 0.0)


def _group_options_with(group: str, subkey: str, config_dir: Path) -> list[str]:
    """Options of config group ``group`` (conf/<group>/<option>.yaml) that define ``subkey``."""
    found = []
    for path in sorted((config_dir / group).glob("*.yaml")):
        try:
            if "@package" in path.read_text().split("\n", 1)[0]:
                continue  # a global package: its keys are not under <group>.
            if has_key(OmegaConf.load(path), subkey):
                found.append(path.stem)
        except Exception:  # an unreadable option never hides the main message
            continue
    return found


def check_overrides(overrides: list[str], config_name: str = "config", config_dir: str | Path = CONFIG_DIR) -> None:
    """Reject key overrides that would change nothing (see the module docstring): keys no config
    defines, and keys the chosen settings ignore.

    Args:
        overrides: Hydra override strings as on the command line (``a.b=1``, ``+c=2``, ...).
        config_name: the primary config.
        config_dir: the config directory.
    Raises:
        UnknownChoiceError: one line per group choice that does not exist (``algorithm=fedavgg``):
            the closest options and all of them (:func:`fedfew.core.registry.unknown_name`).
        UnknownKeyError: one line per unknown key: the override, the closest valid key, the
            group options that define it, and the ``++`` escape (then one line per ignored key).
        IgnoredKeyError: (no unknown key) one line per key the chosen settings ignore: the
            override, the choice that ignores it and the choices that use it.

    Override strings Hydra cannot parse, nested group options (``tuned=<folder>/<preset>``) and
    sweeps that cannot be enumerated are left to Hydra (no error here).
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    if not overrides:
        return
    config_dir = Path(config_dir)
    backup = get_gh_backup()  # callable inside a Hydra app too: its global state comes back after
    GlobalHydra.instance().clear()
    try:
        problems, ignored = _find_problems(overrides, config_name, config_dir)
    finally:
        restore_gh_from_backup(backup)
    ignored_text = ("config key(s) that the chosen settings ignore, so they would change nothing (and their values "
                    "are never checked):\n" + "\n".join(f"  {line}" for line in ignored.values())) if ignored else ""
    if problems:
        from fedfew.core.run_folders import python_command

        raise UnknownKeyError(
            "unknown config key(s); no config defines them, so they would change nothing:\n"
            + "\n".join(f"  {line}" for line in problems.values())
            + "\nto add a key on purpose, force-add it: ++<key>=<value> (see every key with: "
              f"{python_command('fedfew.train')} --cfg job)"
            + (f"\n{ignored_text}" if ignored_text else "")
        )
    if ignored_text:
        raise IgnoredKeyError(ignored_text)


def _find_problems(overrides: list[str], config_name: str, config_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(unknown, ignored): override line -> description of each unknown key, and of each key the
    chosen settings ignore (see :func:`check_overrides`); empty where the check is left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        groups = set(loader.list_groups(""))
        try:
            parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
        except HydraException:
            return {}, {}
        group_overrides, key_overrides, kept = [], [], []
        for o in parsed:
            if o.is_hydra_override():
                continue
            if o.is_delete() or o.is_force_add():
                kept.append(o)  # not checked, but part of the run's config
            elif o.package is not None or "/" in o.key_or_group or o.key_or_group in groups:
                group_overrides.append(o)
            else:
                key_overrides.append(o)
        unknown_choices = _unknown_choices(loader, groups, group_overrides)
        if unknown_choices:
            raise UnknownChoiceError("\n".join(unknown_choices))
        if not key_overrides:
            return {}, {}
        combos = _combinations(group_overrides)
        problems: dict[str, str] = {}
        for combo in combos or []:
            try:
                cfg = compose(config_name=config_name, overrides=list(combo))
            except HydraException:
                return {}, {}  # e.g. a nested group option that does not exist: Hydra's message lists the options
            keys = None
            for o in key_overrides:
                key = o.key_or_group
                if o.input_line in problems or has_key(cfg, key):
                    continue
                keys = keys if keys is not None else config_keys(cfg)
                problems[o.input_line] = _describe(o, key, keys, cfg, config_dir)
        # the keys that exist: composed with every override, does a rule of the chosen settings use them?
        from fedfew.config.rules import ignored_key

        known = [o for o in key_overrides if o.input_line not in problems]
        kept_lines = [o.input_line for o in kept if not o.is_sweep_override()]
        ignored: dict[str, str] = {}
        for combo in (_combinations([*group_overrides, *known]) or []) if known else []:
            try:
                cfg = compose(config_name=config_name, overrides=[*combo, *kept_lines])
            except HydraException:
                break  # Hydra reports it when the run composes
            for o in known:
                why = ignored_key(cfg, o.key_or_group)
                if why and o.input_line not in ignored:
                    ignored[o.input_line] = f"{o.input_line}: {why}"
    return problems, ignored


def _unknown_choices(loader, groups: set[str], overrides: list) -> list[str]:
    """One line per option of a top-level group that ``conf/<group>/`` does not hold (every value
    of a sweep), naming the closest options (:func:`fedfew.core.registry.unknown_name`)."""
    from fedfew.core.registry import unknown_name

    lines = []
    for o in overrides:
        if o.package is not None or o.key_or_group not in groups or (o.is_sweep_override() and not o.is_discrete_sweep()):
            continue
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        options = loader.get_group_options(o.key_or_group)
        lines += [unknown_name(o.key_or_group, value, options) for value in values
                  if options and value not in options and "/" not in value and value != "null"]
    return lines


def _combinations(overrides: list) -> list[tuple[str, ...]] | None:
    """Every combination of the overrides' values (a multirun's discrete sweeps each give several)
    as override strings; None when a sweep cannot be enumerated or there are more than
    :data:`MAX_COMBINATIONS`."""
    choices: list[list[str]] = []
    for o in overrides:
        if o.is_sweep_override():
            if not o.is_discrete_sweep():
                return None
            choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    combos = list(itertools.islice(itertools.product(*choices), MAX_COMBINATIONS + 1))
    return combos if len(combos) <= MAX_COMBINATIONS else None


def _describe(override, key: str, keys: list[str], cfg: DictConfig, config_dir: Path) -> str:
    """One line about an unknown key: the closest valid key and where the key does exist."""
    value = override.get_value_element_as_str() if not override.is_sweep_override() else "..."
    text = f"{override.input_line}: "
    head, _, sub = key.partition(".")
    where = _group_options_with(head, sub, config_dir) if sub and (config_dir / head).is_dir() else []
    choice = cfg.get(head, {}).get("name") if sub and isinstance(cfg.get(head), DictConfig) else None
    if where:
        text += (f"{head}={choice or '<this choice>'} has no key {key} (it exists for {head}="
                 f"{', '.join(where)}); ")
    else:
        text += f"no config defines {key}; "
    best, score = closest_key(key, keys)
    if best is None:
        return text + "this config has no keys"
    if score >= SIMILAR:
        return text + f"closest valid key: {best} (e.g. {best}={value})"
    return text.removesuffix("; ") if where else text + f"no similar key (nearest: {best})"


def main_check(argv: list[str] | None = None) -> None:
    """Run :func:`check_overrides` on ``python -m fedfew.train``'s arguments; on a refused override
    print ``error: ...`` to stderr and exit with status 2 (before Hydra creates a run directory).

    Hydra's own flags (``--help``, ``--info``, ``--config-dir``, ...) skip the check, except
    ``--cfg``/``--multirun``, whose overrides are checked like a run's.
    """
    from hydra._internal.utils import get_args_parser

    argv = sys.argv[1:] if argv is None else argv
    try:
        args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return  # Hydra reports its own usage errors
    if args.help or args.hydra_help or args.info or args.shell_completion or args.config_path or args.config_dir \
            or args.experimental_rerun:
        return
    try:
        check_overrides(list(args.overrides), config_name=args.config_name or "config")
    except OverrideError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
