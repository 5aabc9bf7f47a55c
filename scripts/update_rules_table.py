#!/usr/bin/env python3
"""Rewrite the validated-keys table of docs/configuration.md from ``fedfew.config.rules.rules_markdown()``
(the table between the ``rules:start`` / ``rules:end`` markers; tests/test_config.py checks it):

    .venv/bin/python scripts/update_rules_table.py
"""
from pathlib import Path

from fedfew.config.rules import rules_markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
START, END = "<!-- rules:start -->\n", "\n<!-- rules:end -->"

text = PAGE.read_text()
head, rest = text.split(START)
_, tail = rest.split(END)
PAGE.write_text(head + START + rules_markdown() + END + tail)
print(f"updated {PAGE}")
