"""Throughput sweeps, ours against torch's transport, side by side (issue: the main job).

    pytest bench/test_sweep.py [--bench-quick] [--bench-max-gib G]

Two phases, each measured for both transports (see transports.py):

* ``staging``: ``ShmStager.stage`` against torch's ``DefaultStager.stage``, steady state (the
  staging memory exists; the previous staged copy was dropped);
* ``e2e``: stage + hand the state dict to the writer subprocess + the writer reads one byte of
  every page of every tensor, until the write's future resolves.

Over two axes: state size from 64 MiB up to what this machine allows (``--bench-max-gib``, by
default a fifth of the available memory) at 256 tensors, and tensor count from 16 to 16,384 at
256 MiB. ``--bench-quick`` keeps the small end of both (64 MiB for the count axis). Each
benchmark's group holds the two transports of one case; throughput is in ``extra_info`` and in
the rows of ``--bench-json``.
"""

from __future__ import annotations

import contextlib
import gc
import resource
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pyshmckpt import ShmStager

from conftest import MIB, ROWS, add_row, sweep_cases
from transports import PageTouchingWriter, side, torch_stager


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        cases = sweep_cases(metafunc.config)
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


_STATE: dict[tuple[int, int], dict[str, torch.Tensor]] = {}


def state_for(nbytes: int, count: int) -> dict[str, torch.Tensor]:
    """`nbytes` of float32 as `count` tensors, every page written; the last one is reused."""
    key = (nbytes, count)
    if key not in _STATE:
        _STATE.clear()
        gc.collect()
        per = max(1, nbytes // 4 // count)
        _STATE[key] = {f"layers.{i}.weight": torch.full((per,), float(i)) for i in range(count)}
    return _STATE[key]


@contextlib.contextmanager
def _staging(case: Any) -> Iterator[Callable[[], Any]]:
    sd = state_for(case.nbytes, case.tensors)
    stager = (
        ShmStager(capacity_bytes=case.nbytes + (8 << 20))
        if case.transport == "ours"
        else torch_stager()
    )
    try:
        yield lambda: stager.stage(sd)
    finally:
        stager.close()


@contextlib.contextmanager
def _e2e(case: Any) -> Iterator[Callable[[], Any]]:
    sd = state_for(case.nbytes, case.tensors)
    with side(case.transport, PageTouchingWriter, case.nbytes + (8 << 20)) as (cp, stager):
        yield lambda: cp.write(stager.stage(sd), "unused").result()


# Descriptors the processes hold besides two per tensor (stdio, pipes, libraries, the writer's
# own); measured at a soft limit of 1024, torch's transport works at 480 tensors and fails at 512.
FD_MARGIN = 64


def test_sweep(benchmark, case):
    soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # conftest raised it to the hard one
    needed = 2 * case.tensors + FD_MARGIN
    if case.phase == "e2e" and case.transport == "torch" and needed > soft_limit:
        # Measured: the pickler dup()s one descriptor per storage while the staged copies keep
        # theirs open, and the child receives one per storage too: EMFILE, the child dies.
        reason = (
            f"EMFILE: {case.tensors} tensors need about {2 * case.tensors} + {FD_MARGIN} "
            f"descriptors (RLIMIT_NOFILE {soft_limit})"
        )
        ROWS.append({"phase": case.phase, "transport": case.transport, "nbytes": case.nbytes,
                     "tensors": case.tensors, "median_s": None, "GiB_per_s": None, "error": reason})  # fmt: skip
        pytest.skip(f"torch's pipe transport fails here: {reason}")
    benchmark.group = f"{case.phase}: {case.nbytes // MIB} MiB, {case.tensors} tensors"
    with (_staging if case.phase == "staging" else _e2e)(case) as run:
        benchmark.pedantic(run, rounds=case.rounds, warmup_rounds=1)
    add_row(
        benchmark,
        phase=case.phase,
        transport=case.transport,
        nbytes=case.nbytes,
        tensors=case.tensors,
    )
