"""The package as a whole: what importing it does from an unbuilt source tree, and that
``pyshmckpt.__main__`` runs the command line only as a script."""

from __future__ import annotations

import argparse
import re
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
    from pyshmckpt.cli.commands import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(commands.choices) == 6, sorted(commands.choices)  # cuda-info included
    for command in commands.choices:
        assert command in done.stdout


def test_the_extension_needs_nothing_of_cuda_to_load():
    """The CUDA path is in every build and links nothing of CUDA: the driver is opened at run
    time, so an install on a machine without CUDA (or with any driver) loads and imports."""
    from pyshmckpt.shm import native

    extension = native._C.__file__
    linked = run(["ldd", extension], PACKAGE, child_env())
    assert linked.returncode == 0, linked.stderr
    assert not re.search(r"libcud|libnv|cublas", linked.stdout), linked.stdout
    undefined = run(["nm", "-D", "--undefined-only", extension], PACKAGE, child_env())
    assert undefined.returncode == 0, undefined.stderr
    cuda_symbols = [s for s in undefined.stdout.split() if re.match(r"cu(da)?[A-Z]", s)]
    assert cuda_symbols == []
    assert "dlopen" in undefined.stdout  # how it finds the driver instead


def test_cuda_info_says_the_path_is_built_and_why_it_cannot_run(tmp_path):
    missing = tmp_path / "no-such-driver.so.1"
    env = {**child_env(), "PYSHMCKPT_CUDA_DRIVER": str(missing)}
    done = run([sys.executable, "-m", "pyshmckpt", "cuda-info"], tmp_path, env)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "CUDA path: in this build (driver loaded at run time)", lines
    assert "driver: not loaded" in lines
    assert f"no CUDA driver: {missing} could not be loaded" in lines[-1], lines
    assert lines[-1].startswith("CUDA staging: not usable"), lines
    checked = run(
        [sys.executable, "-c", "import pyshmckpt; print(pyshmckpt.cuda_available())"],
        tmp_path,
        env,
    )
    assert checked.stdout == "False\n", checked.stdout + checked.stderr
