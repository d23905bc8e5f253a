"""The package's shape, checked from its source: layers import downwards only, the native module
and torch's private names each have one door, validation never relies on `assert`, and every
exception raised is one of ours.

These read the source with `ast` (nothing is imported), so they hold for any build.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import pyshmckpt

PACKAGE = Path(pyshmckpt.__file__).resolve().parent
# An installed wheel carries the benchmark suite (bench/, scripts run by `pyshmckpt bench`, not
# modules of the package): the rules below are the package's.
SHIPPED_SUITE = PACKAGE / "bench"

# Bottom to top. A module may import from its own layer and the ones before it, never after.
LAYERS = [
    (
        "foundation",
        {
            "pyshmckpt.errors",
            "pyshmckpt.knobs",
            "pyshmckpt._log",
            "pyshmckpt._lazy",
            "pyshmckpt._gc",
            "pyshmckpt._processes",
            "pyshmckpt._unfilled",
            "pyshmckpt._torch_private",
        },
    ),
    ("shm", {"pyshmckpt.shm"}),
    ("staging", {"pyshmckpt.staging"}),
    ("storage", {"pyshmckpt.storage"}),
    ("tiers", {"pyshmckpt.tiers"}),
    ("transport", {"pyshmckpt.transport"}),
    ("checkpointer", {"pyshmckpt.checkpointer"}),
    ("integrations", {"pyshmckpt.integrations"}),
    ("cli", {"pyshmckpt.cli"}),
    ("package", {"pyshmckpt", "pyshmckpt.__main__"}),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for p in sorted(PACKAGE.rglob("*.py"))
        if not p.is_relative_to(SHIPPED_SUITE)
    }


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix that names `module` or a package holding it."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")
    return best


def _eager(body: list[ast.stmt]) -> list[ast.AST]:
    """The statements of a module's body that run when it is imported: its own, and those of its
    top-level ``if`` (not ``if TYPE_CHECKING``), ``try`` and ``with`` blocks; not function or
    class bodies (a function's import runs when it is called)."""
    out: list[ast.AST] = []
    for node in body:
        if isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                out += _eager(node.body) + _eager(node.orelse)
        elif isinstance(node, ast.Try):
            out += _eager(node.body) + _eager(node.orelse) + _eager(node.finalbody)
            for handler in node.handlers:
                out += _eager(handler.body)
        elif isinstance(node, ast.With):
            out += _eager(node.body)
        else:
            out.append(node)
    return out


def imports(module: str, path: Path, eager: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a pyshmckpt module in `path`, relative ones
    resolved; `from X import y` counts as importing X.y when X.y is a module, else X. With
    `eager`, only the imports that run when the module is imported (see `_eager`)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    known = modules()
    found = []
    for node in _eager(tree.body) if eager else ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, alias.name)
                for alias in node.names
                if alias.name.split(".")[0] == "pyshmckpt"
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "pyshmckpt":
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.append(
                    (node.lineno, candidate if candidate in known or alias.name == "_C" else target)
                )
        elif isinstance(node, ast.Call) and _called(node.func) in ("import_module", "__import__"):
            if (
                node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                if node.args[0].value.split(".")[0] == "pyshmckpt":
                    found.append((node.lineno, node.args[0].value))
    return found


def _called(func: ast.AST) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def test_every_module_belongs_to_a_layer():
    for module in modules():
        layer_of(module)


def test_layers_are_the_package_folders():
    folders = sorted(
        p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()
    )
    assert folders == ["cli", "integrations", "shm", "staging", "storage", "tiers", "transport"]


def test_every_import_points_down():
    upward = []
    for module, path in modules().items():
        here = layer_of(module)
        for line, target in imports(module, path):
            if target == "pyshmckpt._C":
                continue  # checked below
            there = layer_of(target)
            if there > here:
                upward.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {module} ({LAYERS[here][0]}) imports "
                    f"{target} ({LAYERS[there][0]})"
                )
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_modules_import_each_other_when_imported():
    """No cycle of imports that run at import time (within a layer too): a module of the cycle
    would see a half-initialized other, whichever is imported first."""
    graph = {
        module: {target for _, target in imports(module, path, eager=True) if target != module}
        for module, path in modules().items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(trail[trail.index(target) :] + [module, target]))
            elif target in graph and target not in state:
                visit(target, [*trail, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layer_check_resolves_relative_imports(tmp_path):
    """What the walker sees of a module in shm that imports upwards, relatively and absolutely."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from ..transport import channel\nfrom .. import checkpointer\nimport pyshmckpt.cli\n"
    )
    found = [target for _, target in imports("pyshmckpt.shm.probe", probe)]
    assert found == ["pyshmckpt.transport.channel", "pyshmckpt.checkpointer", "pyshmckpt.cli"]
    assert all(layer_of(target) > layer_of("pyshmckpt.shm.probe") for target in found)


def test_only_shm_native_imports_the_compiled_module():
    users = sorted(
        module
        for module, path in modules().items()
        for _, target in imports(module, path)
        if target == "pyshmckpt._C"
    )
    assert users == ["pyshmckpt.shm.native"]


def _is_torch_private(node: ast.AST) -> bool:
    """An attribute chain rooted at `torch` with a private part (torch._C, x.UntypedStorage._y)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "torch"):
        return False
    return any(part.startswith("_") and not part.startswith("__") for part in parts)


def test_torch_private_names_only_in_one_module():
    offenders = []
    for module, path in modules().items():
        if module == "pyshmckpt._torch_private":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            private_import = (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("torch")
                and any(part.startswith("_") for part in (node.module or "").split("."))
            )
            if private_import or (isinstance(node, ast.Attribute) and _is_torch_private(node)):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not offenders, "torch private names outside pyshmckpt/_torch_private.py: " + ", ".join(
        offenders
    )


@pytest.mark.optimize  # the premise of the python -O pass, checked in it too
def test_no_assert_statements_in_the_package():
    """Validation must hold under python -O, which strips assert statements."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert) or (isinstance(node, ast.Name) and node.id == "__debug__")
    ]
    assert not found, f"assert or __debug__ in the package: {found}"


BUILTIN_EXCEPTIONS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}
# Raised on purpose and never an error: interpreter exits and the iterator protocol.
ALLOWED = {"SystemExit", "KeyboardInterrupt", "StopIteration", "GeneratorExit"}
INTERRUPTS = {"BaseException", "SystemExit", "KeyboardInterrupt", "GeneratorExit"}


def test_every_raised_exception_is_ours():
    """`raise ValueError(...)` and the like are errors of no hierarchy: raise an errors.py class
    (or a private control-flow exception caught in the same module)."""
    found = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN_EXCEPTIONS - ALLOWED:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: raise {exc.id}")
    assert not found, "builtin exceptions raised directly:\n" + "\n".join(found)


def test_every_exception_class_derives_from_ours_or_is_private():
    found = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            names = {b.id for b in node.bases if isinstance(b, ast.Name)}
            # Interrupts (BaseException: unwinding on a signal, like KeyboardInterrupt) are
            # control flow, not errors.
            if names & (BUILTIN_EXCEPTIONS - INTERRUPTS) and module != "pyshmckpt.errors":
                found.append(f"{module}.{node.name}")
    assert not found, f"public exception classes outside errors.py: {found}"


@pytest.mark.parametrize("name", [n for n in pyshmckpt.__all__ if n.endswith("Error")])
def test_public_errors_are_pyshmckpt_errors(name):
    assert issubclass(getattr(pyshmckpt, name), pyshmckpt.PyshmckptError)
