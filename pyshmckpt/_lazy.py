"""Lazy package exports (PEP 562): a package's names are imported from their modules on first use.

The writer process imports only the modules it runs (channel, slot mapping, safetensors writer,
commit), none of which needs torch; a package ``__init__`` that imported every module eagerly
would load torch there (about 190 MiB and two seconds). Each package lists its exports here and
imports them under ``TYPE_CHECKING`` as well, for type checkers and the layer checks.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from .errors import PyshmckptError


class _MissingAttributeError(PyshmckptError, AttributeError):
    """What a package's ``__getattr__`` raises for a name it does not export (the attribute
    protocol: ``hasattr`` and ``from package import submodule`` rely on AttributeError)."""


def exports(
    package: str, sources: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for `package`, whose export ``name`` lives in its module
    ``sources[name]`` (relative to the package). A name is imported once, then kept."""

    def getattr_(name: str) -> Any:
        module = sources.get(name)
        if module is None:
            raise no_attribute(package, name)
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(sources))

    return getattr_, dir_


def no_attribute(module: str, name: str) -> AttributeError:
    """The error a module's ``__getattr__`` raises for a name it does not have."""
    return _MissingAttributeError(f"module {module!r} has no attribute {name!r}")
