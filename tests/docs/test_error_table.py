"""The failures guide's error and warning tables against `pyshmckpt.errors`: every error and warning
a caller can import is in its table, once, with the classes it derives from, and every error or
warning a guide names exists.

Nothing here needs mkdocs: the markdown is read as text.
"""

from __future__ import annotations

import builtins
import inspect
import re
from pathlib import Path

import pytest

import pyshmckpt
from pyshmckpt import PyshmckptError, PyshmckptWarning, errors

REPO = Path(__file__).resolve().parents[2]
GUIDES = REPO / "docs" / "guides"
# Every page a user reads: the site's and the front page.
PAGES = sorted([*(REPO / "docs").rglob("*.md"), REPO / "README.md", REPO / "CONTRIBUTING.md"])
FAILURES = GUIDES / "failures.md"


def code_spans(text: str) -> list[str]:
    return re.findall(r"(?<!`)`([^`]+)`(?!`)", text)


def table(path: Path, heading: str) -> list[list[str]]:
    """The body rows of the first table under `heading` (a cell never holds a `|` here)."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip("#").strip() == heading)
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"{path.name}: no table under {heading!r}"
    return [row for row in rows[1:] if not set("".join(row)) <= set("-: ")]


def exported(base: type) -> dict[str, type]:
    return {
        name: obj
        for name in pyshmckpt.__all__
        if inspect.isclass(obj := getattr(pyshmckpt, name)) and issubclass(obj, base)
    }


def documented(heading: str) -> dict[str, set[str]]:
    """Each class of the table under `heading`, with the names its "also a" cell gives."""
    out: dict[str, set[str]] = {}
    for row in table(FAILURES, heading):
        names = code_spans(row[0])
        assert len(names) == 1, f"{heading}: one class per row, not {row[0]}"
        assert names[0] not in out, f"{heading}: {names[0]} is in the table twice"
        out[names[0]] = set(code_spans(row[1]))
    return out


def declared_bases(cls: type) -> set[str]:
    """The classes `cls` derives from directly, less `PyshmckptError`, which every error has
    (the guide says so once)."""
    return {base.__name__ for base in cls.__bases__} - {PyshmckptError.__name__}


def test_every_error_and_warning_of_errors_is_exported() -> None:
    public = {
        name
        for name, obj in inspect.getmembers(errors, inspect.isclass)
        if obj.__module__ == errors.__name__
        and not name.startswith("_")
        and issubclass(obj, (PyshmckptError, PyshmckptWarning))
    }
    assert public - set(pyshmckpt.__all__) == set(), "errors.py classes missing from __all__"


@pytest.mark.parametrize(
    ("heading", "root"), [("Errors", PyshmckptError), ("Warnings", PyshmckptWarning)]
)
def test_table_lists_every_class_with_its_bases(heading: str, root: type) -> None:
    classes, rows = exported(root), documented(heading)
    assert set(classes) - set(rows) == set(), f"{heading}: classes the table lacks"
    assert set(rows) - set(classes) == set(), f"{heading}: rows for no exported class"
    for name, cls in classes.items():
        assert rows[name] == declared_bases(cls), (
            f"{heading}: {name} derives from {sorted(declared_bases(cls))}, "
            f"the table says {sorted(rows[name])}"
        )


def test_every_error_a_guide_names_exists() -> None:
    for path in PAGES:
        for span in code_spans(path.read_text()):
            for name in re.findall(r"\b(\w+(?:Error|Warning))\b", span):
                assert name in pyshmckpt.__all__ or isinstance(
                    getattr(builtins, name, None), type
                ), f"{path.name} names `{name}`, which is neither pyshmckpt's nor a builtin"
