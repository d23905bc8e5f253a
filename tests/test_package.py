"""The package as a whole: what importing it does from an unbuilt source tree, and that
``pyshmckpt.__main__`` runs the command line only as a script."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

import pyshmckpt

from helpers import child_env

PACKAGE = Path(pyshmckpt.__file__).resolve().parent
TIMEOUT = 120


def run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def test_an_unbuilt_source_tree_fails_with_one_clear_import_error(tmp_path):
    """A clone whose extension was never built: one error that says what is missing and what to
    run (not "cannot import name '_C' from partially initialized module ... circular import")."""
    tree = tmp_path / "clone"
    shutil.copytree(
        PACKAGE, tree / "pyshmckpt", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    # No site: neither an installed pyshmckpt nor an editable install's import hook is seen; torch
    # and numpy come from where they are installed.
    site = {str(Path(torch.__file__).resolve().parents[1]), *map(str, sys.path[1:])}
    env = {**child_env(), "PYTHONPATH": ":".join(sorted(site))}
    done = run([sys.executable, "-S", "-c", "import pyshmckpt"], tree, env)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(
        "pyshmckpt.errors.ExtensionMissingError: pyshmckpt's compiled extension"
    ), done.stderr
    assert "pip install" in lines[-1]
    assert "-e ." in lines[-1]
    assert "circular import" not in done.stderr
    assert "During handling of the above exception" not in done.stderr  # one error, not a chain
    assert issubclass(pyshmckpt.ExtensionMissingError, ImportError)


def test_importing_main_does_not_run_the_command_line(tmp_path):
    done = run(
        [sys.executable, "-c", "import pyshmckpt.__main__; print('imported')"],
        tmp_path,
        child_env(),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "imported\n"
    assert done.stderr == ""


def test_python_dash_m_runs_the_command_line(tmp_path):
    done = run([sys.executable, "-m", "pyshmckpt", "--help"], tmp_path, child_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: pyshmckpt")
    for command in ("demo", "bench", "gc", "verify", "inspect"):
        assert command in done.stdout
