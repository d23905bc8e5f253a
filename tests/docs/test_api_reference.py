"""The API reference (docs/reference/*.md, rendered by mkdocstrings) against the package.

The reference is made of ``::: PATH`` directives, each with its options indented below it. These
tests read the pages with regexes and the package's source with `ast`, as mkdocstrings' griffe
does: nothing is imported beyond ``pyshmckpt`` itself (no framework, no mkdocs), so they run in
the test environment.

What they hold the reference to:

- Every name of ``pyshmckpt.__all__`` has a directive under its import path
  (``::: pyshmckpt.Checkpointer``, the heading a user reads), and every public class and
  function of an adapter module of ``pyshmckpt.integrations`` one under its module
  (``::: pyshmckpt.integrations.lightning.ShmCheckpointIO``). Every directive names something
  that exists.
- Public members, the rule: a class's public API is what its directive lists under
  ``members:``. Every method or property defined in the class or in its bases within pyshmckpt
  whose name does not start with ``_`` is either listed there or named in `INTERNAL` below with
  the reason it is not for users (methods the library's own layers call on each other). So a new
  public method fails here until it is documented or declared internal. A class with such
  methods must have a ``members:`` list, and every listed member a docstring (mkdocstrings
  leaves out members without one). Its public attributes (dataclass fields, enum members,
  ``__slots__``, annotated class attributes) are documented in its docstring's ``Attributes:``.
- Parameters: every function and method rendered, and the constructor of every class whose
  signature is shown, documents each of its parameters in ``Args:`` and no other (a dataclass's
  fields may be documented as ``Attributes:``). A class's constructor is shown (mkdocstrings'
  ``merge_init_into_class``) unless its directive sets ``merge_init_into_class: false``, which
  only classes users never construct may do: the errors, and those in `NOT_CONSTRUCTED`.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import pyshmckpt

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "reference").glob("*.md"))
PACKAGE = Path(pyshmckpt.__file__).resolve().parent

# Public methods that are not for users, by the import path of the class that has them (each
# class lists those of its bases too).
INTERNAL: dict[str, dict[str, str]] = {
    "pyshmckpt.ShmStager": {
        "lease": "the transport leases a staged state dict's slot for its writer",
        "stage_leased": "CheckpointProcess stages a plain state dict for its writer alone",
        "segments": "the transport hands the writer the segments to attach",
        "descriptors": "the transport hands the writer the descriptors that keep them alive",
        "detach": "the Checkpointer leaves its segments to the writer when the trainer dies",
        "adopt": "the Checkpointer takes a checkpoint held in memory over as a slot",
        "hold": "the Checkpointer keeps the slot of the newest checkpoint (the memory tier)",
        "prepare": "the Checkpointer plans a save on the caller's thread and copies it on its own",
        "staging_bound": "the Checkpointer bounds its waits for an overlapped save's staging",
    },
    "pyshmckpt.StagedHandle": {
        "segments": "the transport's: the stager's segments for the writer",
        "descriptors": "the transport's: the descriptors that keep them alive",
        "give_back": "ends a lease, which only the transport takes",
    },
    "pyshmckpt.Arena": {
        "transition": "the stager moves slots through their states",
        "hold": "the stager keeps the slot of the newest checkpoint",
        "acquire": "the stager takes a free slot for a stage",
        "find": "the stager finds the slots of a staged state dict",
    },
    "pyshmckpt.Slot": {
        "base": "the stager builds staged tensors over it",
        "fill_from_host": "the stager's first copy into a slot",
        "reserve": "the stager allocates the pages a stage needs",
        "allocate": "the arena allocates pages",
        "populate": "the arena's background thread faults pages in",
        "note_reserved": "the arena records allocated pages",
        "copy_from_host_async": "the stager's host copies",
        "copy_from_device": "the stager's device copies",
        "close": "the arena closes its slots",
    },
    "pyshmckpt.Manifest": {
        "layout_key": "the planner's and reader's cache key",
        "view_args": "make_tensors' per-layout cache",
        "with_tree": "the planner reuses a layout for a new tree",
    },
    "pyshmckpt.CheckpointProcess": {
        "hand_over": "the Checkpointer hands the writer the descriptors of its segments",
        "leave": "the Checkpointer leaves the writer to finish when the trainer dies",
        "leave_holding": "the Checkpointer hands its memory to the writer when an exception ends a with block",
    },
    "pyshmckpt.CheckpointProcessConfig": {
        "starting_in_background": "the Checkpointer's and the DeepSpeed adapter's default",
    },
}
# Classes handed out by the library whose constructor is not for users (no signature shown).
NOT_CONSTRUCTED = {"pyshmckpt.StagedHandle", "pyshmckpt.Slot"}  # made by a stager or an arena
# Modules of pyshmckpt.integrations that are not adapters a user imports.
INTERNAL_MODULES = {"deepspeed_latest": "the writer process's side of the DeepSpeed adapter"}


@dataclass
class Directive:
    page: str
    path: str
    options: dict[str, object] = field(default_factory=dict)


def directives() -> list[Directive]:
    """Every ``::: PATH`` of the reference pages with its options (scalars and lists)."""
    out = []
    for page in PAGES:
        for match in re.finditer(r"^::: (\S+)\n((?:[ ]{4}.*\n|\n)*)", page.read_text(), re.M):
            options: dict[str, object] = {}
            key = None
            for line in match.group(2).splitlines():
                if m := re.match(r"^ {6}(\w+):\s*(.*)$", line):
                    key, value = m.groups()
                    if value.startswith("["):
                        options[key] = [v.strip() for v in value.strip("[]").split(",") if v]
                    else:
                        options[key] = [] if value == "" else value
                elif (m := re.match(r"^ {8}- (\S+)$", line)) and key is not None:
                    listed = options[key]
                    assert isinstance(listed, list)
                    listed.append(m.group(1))
            out.append(Directive(page.name, match.group(1), options))
    return out


# -- reading the source as griffe does -----------------------------------------------------


def module_file(module: str) -> Path | None:
    parts = module.split(".")[1:]
    base = PACKAGE.joinpath(*parts)
    for candidate in ((base.with_suffix(".py"),) if parts else ()) + (base / "__init__.py",):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def tree(module: str) -> ast.Module:
    path = module_file(module)
    assert path is not None, module
    return ast.parse(path.read_text())


def statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Top-level statements, those under ``if`` (``TYPE_CHECKING``) and ``try`` included."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            out += statements(node.body) + statements(node.orelse)
        elif isinstance(node, ast.Try):
            out += statements(node.body)
        else:
            out.append(node)
    return out


Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def resolve(module: str, name: str) -> tuple[str, Definition] | None:
    """The class or function `name` of `module`, defined there or imported from another module
    of the package (the aliases griffe follows); None when there is none."""
    for node in statements(tree(module).body):
        if isinstance(node, Definition) and node.name == name:
            return module, node
    for node in statements(tree(module).body):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) != name:
                    continue
                source = absolute(module, node)
                if source is not None and module_file(source) is not None:
                    return resolve(source, alias.name)
    return None


def absolute(module: str, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module if (node.module or "").startswith("pyshmckpt") else None
    package = module if module_file(module).name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def lookup(path: str) -> tuple[str, Definition | None] | None:
    """What a directive's path names: a module (definition None) or a class or function."""
    if module_file(path) is not None:
        return path, None
    module, _, name = path.rpartition(".")
    if module_file(module) is None:
        return None
    return resolve(module, name)


def is_exception(module: str, node: ast.ClassDef) -> bool:
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in ("Exception", "Warning", "UserWarning"):
            return True
        found = resolve(module, base.id) if isinstance(base, ast.Name) else None
        if found is not None and isinstance(found[1], ast.ClassDef) and is_exception(*found):
            return True
    return False


def lineage(module: str, node: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
    """The class and its bases defined in the package, nearest first."""
    out = [(module, node)]
    for base in node.bases:
        found = resolve(module, base.id) if isinstance(base, ast.Name) else None
        if found is not None and isinstance(found[1], ast.ClassDef):
            out += [c for c in lineage(*found) if c not in out]
    return out


def decorated(node: Definition, name: str) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (isinstance(target, ast.Name) and target.id == name) or (
            isinstance(target, ast.Attribute) and target.attr == name
        ):
            return True
    return False


def is_enum(node: ast.ClassDef) -> bool:
    return any(
        (isinstance(b, ast.Name) and b.id.endswith("Enum"))
        or (isinstance(b, ast.Attribute) and b.attr.endswith("Enum"))
        for b in node.bases
    )


def methods(module: str, node: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function defined in the class or its bases in the package, the nearest first."""
    out: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for _, cls in lineage(module, node):
        for item in cls.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                out.setdefault(item.name, item)
    return out


def public_attributes(node: ast.ClassDef) -> set[str]:
    """Declared attributes: annotated class attributes (dataclass fields), enum members,
    ``__slots__`` entries; public ones."""
    out = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if not isinstance(target, ast.Name):
                    continue
                if target.id == "__slots__" and isinstance(item.value, ast.Tuple | ast.List):
                    out |= {e.value for e in item.value.elts if isinstance(e, ast.Constant)}
                elif is_enum(node):
                    out.add(target.id)
    return {name for name in out if not name.startswith("_")}


def dataclass_fields(node: ast.ClassDef) -> list[str]:
    return [
        item.target.id
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]


def section(doc: str | None, title: str) -> list[str]:
    """The names a Google-style section (``Args:``, ``Attributes:``) documents, stars kept."""
    lines = (doc or "").expandtabs().splitlines()
    names: list[str] = []
    for i, line in enumerate(lines):
        if line.strip() != f"{title}:":
            continue
        indent = len(line) - len(line.lstrip())
        entry = None
        for following in lines[i + 1 :]:
            if not following.strip():
                continue
            depth = len(following) - len(following.lstrip())
            if depth <= indent:
                break
            entry = entry if entry is not None else depth
            if depth == entry and (m := re.match(r"\s*(\*{0,2}\w+)(?: \(.*?\))?:", following)):
                names.append(m.group(1))
    return names


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return [n for n in names if n not in ("self", "cls")]


def undocumented(params: list[str], documented: list[str]) -> tuple[set[str], set[str]]:
    """(parameters not documented, documented names that are no parameter); stars optional."""
    bare = {p.lstrip("*"): p for p in params}
    given = {d.lstrip("*") for d in documented}
    return {bare[p] for p in set(bare) - given}, given - set(bare)


# -- the tests -----------------------------------------------------------------------------


def resolved() -> list[tuple[Directive, str, Definition | None]]:
    out = []
    for directive in directives():
        found = lookup(directive.path)
        assert found is not None, f"{directive.page}: ::: {directive.path} names nothing"
        out.append((directive, *found))
    return out


def test_every_directive_names_something_that_exists():
    assert directives(), "no directive found: the pages or the pattern moved"
    for directive in directives():
        assert lookup(directive.path) is not None, f"{directive.page}: ::: {directive.path}"


def test_every_exported_name_has_a_directive_under_its_import_path():
    paths = [d.path for d in directives()]
    exported = {f"pyshmckpt.{name}" for name in pyshmckpt.__all__}
    assert sorted(exported - set(paths)) == []
    assert len(paths) == len(set(paths)), "a name is documented twice"
    # Names of the package are documented as ``pyshmckpt.NAME``, not under their modules.
    for directive, _, node in resolved():
        if node is None or directive.path.startswith("pyshmckpt.integrations."):
            continue
        assert directive.path in exported, (
            f"{directive.page}: ::: {directive.path} is not a name of pyshmckpt.__all__"
        )


def adapter_modules() -> list[str]:
    folder = PACKAGE / "integrations"
    return [
        f"pyshmckpt.integrations.{p.stem}"
        for p in sorted(folder.glob("*.py"))
        if not p.stem.startswith("_") and p.stem not in INTERNAL_MODULES
    ]


def test_every_adapter_and_its_public_names_are_documented():
    paths = {d.path for d in directives()}
    for module in adapter_modules():
        names = [
            node.name
            for node in tree(module).body
            if isinstance(node, Definition) and not node.name.startswith("_")
        ]
        assert names, module
        for name in names:
            assert f"{module}.{name}" in paths, f"{module}.{name} has no directive"


def test_rendered_members_are_exactly_the_public_api():
    for directive, module, node in resolved():
        if not isinstance(node, ast.ClassDef):
            continue
        public = {n for n in methods(module, node) if not n.startswith("_")}
        internal = INTERNAL.get(directive.path, {})
        listed = directive.options.get("members")
        if not public:
            assert not listed, f"{directive.path}: members listed for a class without any"
            continue
        assert isinstance(listed, list), f"{directive.path}: no members: list"
        assert not set(listed) & set(internal), f"{directive.path}: rendered and internal"
        assert sorted(set(listed) | set(internal)) == sorted(public), (
            f"{directive.path}: public methods neither rendered nor internal: "
            f"{sorted(public - set(listed) - set(internal))}; named but not public methods: "
            f"{sorted((set(listed) | set(internal)) - public)}"
        )
        for name in listed:
            assert ast.get_docstring(methods(module, node)[name]), f"{directive.path}.{name}"
    assert {path for path in INTERNAL} <= {d.path for d in directives()}


def test_public_attributes_are_documented():
    for directive, _, node in resolved():
        if not isinstance(node, ast.ClassDef):
            continue
        documented = set(section(ast.get_docstring(node), "Attributes"))
        missing = public_attributes(node) - documented
        assert not missing, f"{directive.path}: attributes not in its Attributes: {missing}"


def callables() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function rendered: the module-level ones and each class's listed members."""
    out = []
    for directive, module, node in resolved():
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.append((directive.path, node))
        elif isinstance(node, ast.ClassDef):
            members = methods(module, node)
            listed = directive.options.get("members")
            for name in listed if isinstance(listed, list) else []:
                function = members[name]
                if not decorated(function, "property") and not decorated(
                    function, "cached_property"
                ):
                    out.append((f"{directive.path}.{name}", function))
    return out


@pytest.mark.parametrize("path", [p for p, _ in callables()])
def test_every_rendered_function_documents_its_parameters(path):
    (function,) = [f for p, f in callables() if p == path]
    missing, unknown = undocumented(
        parameters(function), section(ast.get_docstring(function), "Args")
    )
    assert not missing, f"{path}: parameters not in Args: {sorted(missing)}"
    assert not unknown, f"{path}: Args that are no parameter: {sorted(unknown)}"


def test_constructors_are_shown_with_every_parameter_documented():
    for directive, module, node in resolved():
        if not isinstance(node, ast.ClassDef):
            continue
        if directive.options.get("merge_init_into_class") == "false":
            assert is_exception(module, node) or directive.path in NOT_CONSTRUCTED, (
                f"{directive.path}: its constructor is hidden, but users construct it"
            )
            continue
        init = methods(module, node).get("__init__")
        docs = section(ast.get_docstring(node), "Args")
        if init is not None:
            params = parameters(init)
            docs += section(ast.get_docstring(init), "Args")
        elif decorated(node, "dataclass"):
            params = dataclass_fields(node)
            docs += section(ast.get_docstring(node), "Attributes")
        else:
            continue  # object's, or a framework base's: nothing to document
        missing, unknown = undocumented(params, docs)
        assert not missing, f"{directive.path}: constructor parameters not documented: {missing}"
        assert not unknown, f"{directive.path}: Args that are no parameter: {unknown}"


def test_the_signature_options_that_make_headings_and_constructors_readable():
    """The site's mkdocstrings options this page relies on (mkdocs.yml is read as text: the
    test environment has no YAML parser of its own)."""
    config = (ROOT / "mkdocs.yml").read_text()
    for option in ("merge_init_into_class: true", "separate_signature: true"):
        assert re.search(rf"^\s+{re.escape(option)}$", config, re.M), option
