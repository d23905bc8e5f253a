"""The configuration guide against the code: its environment variables (every ``PYSHMCKPT_*`` the
package or its extension reads, each default and least value), the parameter tables of
`Checkpointer`, `Checkpointer.save`, `Checkpointer.load`, `ShmStager`, `load` and
`CheckpointProcessConfig` (every parameter, each default as `inspect.signature` gives it), the
signatures the guides write out, and every default quoted beside a variable's name in a guide.

Nothing here needs mkdocs, a network or a writer process: the markdown is read as text and the
integrations' signatures from their source (importing the frameworks takes seconds).
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import pyshmckpt
from pyshmckpt import ConfigError, knobs

REPO = Path(__file__).resolve().parents[2]
GUIDES = REPO / "docs" / "guides"
# Every page a user reads: the site's and the front page.
PAGES = sorted([*(REPO / "docs").rglob("*.md"), REPO / "README.md", REPO / "CONTRIBUTING.md"])
CONFIGURATION = GUIDES / "configuration.md"
CSRC = REPO / "csrc"
PACKAGE = Path(pyshmckpt.__file__).resolve().parent
# An installed wheel carries the benchmark suite (bench/) inside the package.
SHIPPED_SUITE = PACKAGE / "bench"
VARIABLE = re.compile(r"PYSHMCKPT_[A-Z0-9_]+")
UNITS = {"": 1, "s": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def split_row(line: str) -> list[str]:
    """The cells of a markdown table row; a `|` inside a code span does not split."""
    cells, cell, in_code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
    cells.append(cell.strip())
    return cells


def tables(path: Path) -> dict[str, list[list[str]]]:
    """The body rows of the first table under each heading, by the heading's text."""
    found: dict[str, list[list[str]]] = {}
    heading, rows, in_code = "", None, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        if line.startswith("#"):
            heading, rows = line.lstrip("#").strip(), None
        elif line.startswith("|") and heading not in found and rows is None:
            rows = []  # the header row
        elif line.startswith("|") and rows is not None and heading not in found:
            if not set(line) <= set("|-: "):
                rows.append(split_row(line))
        elif rows is not None and heading not in found:
            found[heading] = rows
    if rows is not None and heading not in found:
        found[heading] = rows
    return found


def code_spans(text: str) -> list[str]:
    return re.findall(r"(?<!`)`([^`]+)`(?!`)", text)


# -- environment variables -------------------------------------------------------------------


def variables_read() -> set[str]:
    """Every PYSHMCKPT_* name the package reads: a string literal that is exactly the name (what
    `knobs` and any ``os.environ.get`` pass), and every ``getenv("...")`` of the extension."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if SHIPPED_SUITE in path.parents:  # bench/'s own options, documented with the suite
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if VARIABLE.fullmatch(node.value):
                    names.add(node.value)
    for path in [*CSRC.rglob("*.cpp"), *CSRC.rglob("*.h")]:
        names |= set(re.findall(r'getenv\(\s*"(PYSHMCKPT_[A-Z0-9_]+)"', path.read_text()))
    return names


def knob_functions() -> dict[str, Any]:
    """The reader of each variable in `knobs`: its public functions, each docstring opening
    with the variable's name."""
    readers = {}
    for name, function in inspect.getmembers(knobs, inspect.isfunction):
        if name.startswith("_") or function.__module__ != knobs.__name__:
            continue
        match = VARIABLE.match(inspect.getdoc(function) or "")
        assert match, f"knobs.{name}'s docstring does not open with the variable it reads"
        readers[match.group()] = function
    return readers


def variable_rows() -> dict[str, list[str]]:
    rows = tables(CONFIGURATION)["Environment variables"]
    out = {}
    for row in rows:
        (name,) = code_spans(row[0])
        assert name not in out, f"{name} is in the table twice"
        out[name] = row
    return out


def cuda_driver_default() -> str:
    match = re.search(r'kDefaultLibrary\s*=\s*"([^"]+)"', (CSRC / "cuda_driver.cpp").read_text())
    assert match, "csrc/cuda_driver.cpp no longer names its default library as kDefaultLibrary"
    return match.group(1)


def thread_pool_cap() -> int:
    source = (CSRC / "thread_pool.cpp").read_text()
    match = re.search(r"hardware_concurrency\(\)\),\s*(\d+)\)", source)
    assert match, "csrc/thread_pool.cpp no longer caps its default size as min(cores, N)"
    return int(match.group(1))


def defaults(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Each variable's value when unset, as the code reads it."""
    readers = knob_functions()
    for name in readers:
        monkeypatch.delenv(name, raising=False)
    values = {name: read() for name, read in readers.items()}
    values["PYSHMCKPT_CUDA_DRIVER"] = cuda_driver_default()  # read by the extension alone
    return values


def documented_number(text: str) -> float:
    return float(int(text, 0)) if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", text) else float(text)


def test_every_variable_read_is_in_the_table_and_no_other() -> None:
    read, documented = variables_read(), set(variable_rows())
    assert read - documented == set(), "variables the code reads that the table lacks"
    assert documented - read == set(), "variables in the table that nothing reads"


def test_every_variable_of_knobs_has_its_reader() -> None:
    read_in_python = {
        name for name in variables_read() if name != "PYSHMCKPT_CUDA_DRIVER"
    }  # the extension reads that one itself
    assert set(knob_functions()) == read_in_python


def test_table_defaults_are_the_code_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = variable_rows()
    for name, value in defaults(monkeypatch).items():
        cell = rows[name][1]
        spans = code_spans(cell)
        if value is None:  # no fixed value: the cell says in words what it is
            assert not cell.startswith("`"), f"{name}: no fixed default, the table says {cell}"
            if name == "PYSHMCKPT_THREADS":
                assert f"up to {thread_pool_cap()}" in cell, f"{name}: {cell}"
            continue
        assert cell.startswith("`"), (
            f"{name}: the code's default is {value!r}, the table says {cell}"
        )
        if isinstance(value, str):
            assert spans[0] == value, f"{name}: the code's default is {value!r}, not {spans[0]}"
        else:
            assert documented_number(spans[0]) == float(value), (
                f"{name}: the code's default is {value!r}, the table says {spans[0]}"
            )
            for number, unit in re.findall(r"\(([\d.]+) (KiB|MiB|GiB)\)", cell):
                assert float(number) * UNITS[unit] == float(value), f"{name}: {cell}"


def test_least_values_are_the_ones_enforced(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = variable_rows()
    unset = defaults(monkeypatch)
    for name, read in knob_functions().items():
        if not isinstance(unset[name], (int, float)) or isinstance(unset[name], bool):
            continue  # a string, a flag, or no fixed default (PYSHMCKPT_THREADS: below)
        stated = re.search(r"at least ([\d.]+)", rows[name][2])
        monkeypatch.setenv(name, "0")
        try:
            read()
            zero_accepted = True
        except ConfigError:
            zero_accepted = False
        if stated is None:
            assert zero_accepted, f"{name} rejects 0, and the table does not say its least value"
            continue
        least = stated.group(1)
        monkeypatch.setenv(name, least)
        read()  # accepted
        below = float(least) - (1 if "." not in least else 0.5)
        monkeypatch.setenv(name, repr(below) if "." in least else str(int(below)))
        with pytest.raises(ConfigError):
            read()
    monkeypatch.setenv("PYSHMCKPT_THREADS", "0")
    with pytest.raises(ConfigError):
        knobs.copy_threads()
    assert "at least 1" in rows["PYSHMCKPT_THREADS"][2]


def test_defaults_quoted_beside_a_variable_in_the_guides(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PYSHMCKPT_X` (120 s)``, ``(`PYSHMCKPT_X`, 2)``, ``60 by default, `PYSHMCKPT_X```: the
    number is the variable's default; every variable a guide names exists."""
    values = defaults(monkeypatch)
    after = re.compile(r"`(PYSHMCKPT_\w+)`(?:,|:| \()\s*([\d][\d,.]*\d|\d)\s*(s|KiB|MiB|GiB)?\b")
    before = re.compile(r"\b([\d][\d,.]*\d|\d)\s*(s|KiB|MiB|GiB)? by default, `(PYSHMCKPT_\w+)`")
    checked = 0
    for path in PAGES:
        text = " ".join(path.read_text().split())  # a quote may span a line break
        for name in set(re.findall(r"PYSHMCKPT_[A-Z0-9_]+\b", text)):
            assert name in values, f"{path.name} names {name}, which nothing reads"
        quotes = [(m[0], m[1], m[2]) for m in after.findall(text)]
        quotes += [(m[2], m[0], m[1]) for m in before.findall(text)]
        for name, number, unit in quotes:
            value = values[name]
            if name == "PYSHMCKPT_CUDA_DRIVER" or value is None or isinstance(value, str):
                continue
            quoted = float(number.replace(",", "")) * UNITS[unit or ""]
            assert quoted == float(value), f"{path.name}: {name} quoted as {number} {unit}"
            checked += 1
    assert checked >= 10, "the patterns above no longer find the guides' quotes"


# -- parameters ------------------------------------------------------------------------------

_MISSING = object()


def real_parameters(target: Any) -> dict[str, tuple[inspect._ParameterKind, Any]]:
    signature = inspect.signature(target)
    return {
        name: (p.kind, _MISSING if p.default is inspect.Parameter.empty else p.default)
        for name, p in signature.parameters.items()
        if name != "self"
    }


def source_parameters(module: str, qualname: str) -> dict[str, tuple[inspect._ParameterKind, Any]]:
    """A signature read from the package's source, for modules too slow to import here: each
    default as its literal value, or as the source text of a non-literal (`TorchFileWriter`)."""
    tree = ast.parse((PACKAGE / (module.replace(".", "/") + ".py")).read_text())
    nodes: list[ast.AST] = list(tree.body)
    function = None
    for part in qualname.split("."):
        function = next(
            n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part
        )
        nodes = list(getattr(function, "body", []))
    if isinstance(function, ast.ClassDef):
        function = next(n for n in nodes if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert isinstance(function, ast.FunctionDef)
    return arguments(function.args)


def literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def arguments(args: ast.arguments) -> dict[str, tuple[inspect._ParameterKind, Any]]:
    kind = inspect.Parameter
    out: dict[str, tuple[inspect._ParameterKind, Any]] = {}
    positional = [*args.posonlyargs, *args.args]
    padded = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(positional, padded, strict=True):
        out[arg.arg] = (
            kind.POSITIONAL_OR_KEYWORD,
            _MISSING if default is None else literal(default),
        )
    if args.vararg:
        out[args.vararg.arg] = (kind.VAR_POSITIONAL, _MISSING)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out[arg.arg] = (kind.KEYWORD_ONLY, _MISSING if default is None else literal(default))
    if args.kwarg:
        out[args.kwarg.arg] = (kind.VAR_KEYWORD, _MISSING)
    out.pop("self", None)
    return out


TABLES = {
    "Checkpointer": lambda: real_parameters(pyshmckpt.Checkpointer),
    "Checkpointer.save": lambda: real_parameters(pyshmckpt.Checkpointer.save),
    "Checkpointer.load": lambda: real_parameters(pyshmckpt.Checkpointer.load),
    "ShmStager": lambda: real_parameters(pyshmckpt.ShmStager),
    "CheckpointProcessConfig": lambda: real_parameters(pyshmckpt.CheckpointProcessConfig),
    "load": lambda: real_parameters(pyshmckpt.load),
}


@pytest.mark.parametrize("heading", sorted(TABLES))
def test_parameter_table_is_the_signature(heading: str) -> None:
    real = TABLES[heading]()
    documented: dict[str, str] = {}
    for row in tables(CONFIGURATION)[heading]:
        for name in code_spans(row[0]):
            assert name not in documented, f"{heading}: {name} is in the table twice"
            documented[name] = row[1]
    assert set(real) - set(documented) == set(), f"{heading}: parameters the table lacks"
    assert set(documented) - set(real) == set(), f"{heading}: rows for no parameter"
    for name, cell in documented.items():
        default = real[name][1]
        if default is _MISSING:
            assert cell == "(required)", f"{heading}: {name} has no default, the table says {cell}"
            continue
        spans = code_spans(cell)
        assert cell.startswith("`"), f"{heading}: {name}'s default is {default!r}, not {cell}"
        value = literal(ast.parse(spans[0], mode="eval").body)
        # `2` for 2.0 would be a different default to type checks and to a reader alike
        assert (value, type(value)) == (default, type(default)), (
            f"{heading}: {name}'s default is {default!r}, the table says {spans[0]}"
        )


SIGNATURES = {
    "Checkpointer": lambda: real_parameters(pyshmckpt.Checkpointer),
    "save": lambda: real_parameters(pyshmckpt.Checkpointer.save),
    "load": lambda: real_parameters(pyshmckpt.load),
    "ShmStager": lambda: real_parameters(pyshmckpt.ShmStager),
    "CheckpointProcessConfig": lambda: real_parameters(pyshmckpt.CheckpointProcessConfig),
    "CheckpointProcess": lambda: real_parameters(pyshmckpt.CheckpointProcess),
    "verify": lambda: real_parameters(pyshmckpt.verify),
    "ShmCheckpointIO": lambda: source_parameters("integrations.lightning", "ShmCheckpointIO"),
    "ShmCheckpointEngine": lambda: source_parameters(
        "integrations.deepspeed", "ShmCheckpointEngine"
    ),
    "use_pyshmckpt": lambda: source_parameters("integrations.deepspeed", "use_pyshmckpt"),
    "ShmStateSaver": lambda: source_parameters("integrations.accelerate", "ShmStateSaver"),
}


def written_signatures() -> list[tuple[str, str, str]]:
    """(guide, callable, parameters) of each signature a guide writes out: a code span
    ``name(...)`` of a callable above with a bare ``*`` or a ``**name`` (which no call has)."""
    found = []
    for path in PAGES:
        for span in code_spans(path.read_text()):
            span = " ".join(span.split())
            match = re.fullmatch(r"(?:pyshmckpt\.)?(\w+)\((.*)\)", span)
            if match is None or match.group(1) not in SIGNATURES:
                continue
            if re.search(r"(^|,)\s*\*\s*(,|$)|\*\*\w", match.group(2)):
                found.append((path.name, match.group(1), match.group(2)))
    return found


def test_signatures_the_guides_write_out() -> None:
    written = written_signatures()
    assert {name for _, name, _ in written} >= {"Checkpointer", "save", "load", "ShmStager"}
    for guide, name, text in written:
        parts = [p.strip() for p in text.split(",")]
        partial = "..." in parts
        parts = [p for p in parts if p != "..."]
        while parts and parts[-1] == "*":  # `Checkpointer(root, *, ...)`: the rest elided
            parts.pop()
        documented = arguments(ast.parse(f"def f({', '.join(parts)}): pass").body[0].args)  # type: ignore[attr-defined]
        real = SIGNATURES[name]()
        where = f"{guide}: `{name}({text})`"
        assert set(documented) <= set(real), f"{where}: {set(documented) - set(real)} unknown"
        if not partial:
            assert set(documented) == set(real), f"{where} lacks {set(real) - set(documented)}"
        for parameter, (kind, default) in documented.items():
            real_kind, real_default = real[parameter]
            if real_kind == inspect.Parameter.POSITIONAL_ONLY:
                real_kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            assert kind == real_kind, f"{where}: {parameter} is {real_kind.description}"
            if not isinstance(real_default, (int, float, str, bool, type(None))) and (
                real_default is not _MISSING
            ):
                real_default = getattr(real_default, "__name__", real_default)
            assert default == real_default, (
                f"{where}: {parameter}'s default is {real_default!r}, not {default!r}"
            )
