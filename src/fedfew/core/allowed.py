"""Allowed values written in words, and the check each text states.

A key's allowed values are declared once, as text (``"integer >= 1"``, ``"number in (0, 1]"``,
``"uniform | samples"``): the config validation (:mod:`fedfew.config.rules`, before torch is
imported), the docs tables and an algorithm's constructor (:meth:`fedfew.algorithms.base.Algorithm`,
through :func:`check_value`) all read the same text. Plain Python: no torch, no config.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable


def is_int(v: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


COMPARE = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b, "<": lambda a, b: a < b}


def _literal(token: str) -> Any:
    """A choice token as it is compared: ``true``/``false`` as bools, anything else as a string."""
    return {"true": True, "false": False}.get(token, token)


def _one_check(spec: str) -> Callable[[Any], bool]:
    """The check of one alternative of an allowed-values text (see :func:`check_of`)."""
    kinds = {"integer": is_int, "number": is_number}
    if spec == "null":
        return lambda v: v is None
    m = re.fullmatch(r"(integer|number) (>=|>|<=|<) (-?[0-9.]+)", spec)
    if m:
        kind, op, bound = kinds[m.group(1)], COMPARE[m.group(2)], float(m.group(3))
        return lambda v: kind(v) and op(v, bound)
    m = re.fullmatch(r"(integer|number) in ([\[(])(-?[0-9.]+), (-?[0-9.]+)([\])])", spec)
    if m:
        kind, low, high = kinds[m.group(1)], float(m.group(3)), float(m.group(4))
        above = COMPARE[">=" if m.group(2) == "[" else ">"]
        below = COMPARE["<=" if m.group(5) == "]" else "<"]
        return lambda v: kind(v) and above(v, low) and below(v, high)
    tokens = [s.strip() for s in spec.split("|")]
    if all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", s) for s in tokens):
        choices = [_literal(s) for s in tokens]
        return lambda v: any(v == c and type(v) is type(c) for c in choices)
    raise ValueError(f"cannot read the allowed values {spec!r}: write 'integer >= 1', 'number > 0', "
                     "'number in (0, 1]', 'a | b | c', 'null', or alternatives joined by ' or '")


def check_of(allowed: str) -> Callable[[Any], bool]:
    """The check that an allowed-values text states, so a key is declared once, in words.

    The text is alternatives joined by `` or `` (a comma before it is allowed), each one of
    ``integer >= 1`` (also ``>``, ``<=``, ``<``), ``number in (0, 1]`` (brackets as in maths),
    ``a | b | c`` (choices; ``true`` and ``false`` are booleans) or ``null``; a closing
    parenthesis at the end is a note, not part of the check. E.g.
    ``"integer >= 1, or auto (start with K_max models)"``.

    Raises:
        ValueError: a text this grammar cannot read (named).
    """
    spec = allowed.strip()
    if spec.endswith(")"):  # a note: drop the balanced parenthesis that ends the text
        depth = 0
        for i in range(len(spec) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(spec[i], 0)
            if depth == 0:
                break
        if spec[:i].endswith(" ") and not spec[:i].rstrip().endswith((",", "in")):
            spec = spec[:i].strip()
    checks = [_one_check(part.strip().rstrip(",").strip()) for part in spec.replace(", or ", " or ").split(" or ")]
    return lambda v: any(check(v) for check in checks)


def check_value(key: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError("<key>=<value>: allowed <allowed>")`` unless ``value`` passes the check
    that ``allowed`` states (:func:`check_of`); the same wording as the config validation's."""
    if not check_of(allowed)(value):
        raise ValueError(f"{key}={value!r}: allowed {allowed}")
