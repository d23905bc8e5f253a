"""docs/reference/cli.md against the ``pyshmckpt`` parser: the commands and options are read
from `pyshmckpt.cli.commands.build_parser` (building it imports neither torch nor mkdocs), never
from a list kept here.

The page has one ``## `pyshmckpt COMMAND` `` section per command, each with its options and
their defaults in a table (``| option | default | meaning |``), and says what each command
returns as ``Exit status:``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pyshmckpt.cli.commands import build_parser

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"
NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def commands() -> dict[str, argparse.ArgumentParser]:
    """Each command's name and parser, in the parser's order."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def sections() -> dict[str, str]:
    """The page's text under each ``## `pyshmckpt NAME` `` heading, by NAME."""
    text = PAGE.read_text()
    found = re.findall(r"^## `pyshmckpt ([\w-]+)`\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return dict(found)


def option_rows(section: str) -> dict[str, str]:
    """The section's option table: the first cell of each row (the options) to its second (the
    default)."""
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            rows[cells[0]] = cells[1]
    return rows


def documented_default(default: object) -> str | None:
    """How a default must appear in the table, where it is a value a user types (numbers,
    words, paths); None for the ones the page says in words (None, a flag's False, True)."""
    if default is None or isinstance(default, bool):
        return None
    if isinstance(default, float):
        return format(default, "g")
    return str(default)


def test_every_command_has_a_section_and_no_section_is_for_a_command_that_is_gone():
    assert list(sections()) == list(commands())


@pytest.mark.parametrize("name", list(commands()))
def test_every_option_of_a_command_is_in_its_table_with_its_default(name):
    section = sections()[name]
    rows = option_rows(section)
    for action in commands()[name]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            # Every spelling, --no-direct-io of a BooleanOptionalAction included.
            spellings = [s for s in action.option_strings if s.startswith("--")]
        else:  # a positional: its name as the usage line shows it
            spellings = [action.dest.upper()]
        cells = [
            cell
            for cell in rows
            if all(re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", cell) for s in spellings)
        ]
        assert cells, f"pyshmckpt {name}: {spellings} missing from the options table"
        expected = documented_default(action.default)
        if expected is not None:
            assert f"`{expected}`" in rows[cells[0]], (
                f"pyshmckpt {name} {spellings[0]}: the default is {action.default!r}, "
                f"the page says {rows[cells[0]]!r}"
            )
    if not rows:  # a command without options says so
        assert "no options" in section


@pytest.mark.parametrize("name", list(commands()))
def test_every_command_says_its_exit_status_and_shows_an_example(name):
    section = sections()[name]
    assert "Exit status:" in section
    assert re.search(rf"```(bash|console)\n(\$ )?pyshmckpt {name}\b", section), name


def test_counts_of_commands_in_prose_match_the_parser():
    text = PAGE.read_text()
    said = re.findall(rf"\b({'|'.join(NUMBERS)}) commands\b", text, re.I)
    assert said, "the page says how many commands there are"
    assert {NUMBERS.index(word.lower()) for word in said} == {len(commands())}


def test_the_command_summary_table_lists_every_command_once():
    text = PAGE.read_text()
    listed = re.findall(r"^\| \[`pyshmckpt ([\w-]+)`\]\(#", text, re.M)
    assert listed == list(commands())
