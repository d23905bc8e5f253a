"""Stage + handoff + persist benchmarks (issue: writer subprocess), ours against torch's transport.

    pytest bench/test_handoff.py

One round is one checkpoint: stage the state dict, hand it to the writer subprocess and wait
until the writer has read one byte of every page of every tensor. Sides:

* ours, ShmStager: ``ShmStager.stage`` + ``pyshmckpt.CheckpointProcess.write`` (manifest only);
* ours, plain: ``pyshmckpt.CheckpointProcess.write`` of the plain state dict (staged inside);
* torch: ``DefaultStager`` (shared memory, synchronous) + torch's ``CheckpointProcess.write``,
  which pickles the state dict through its pipe (one file descriptor per storage).

Each side has its own freshly spawned writer process, created before timing starts. "Handoff
alone" is the time from write() of an already-staged state dict until the writer's no-op
``write`` has been called and has answered.
"""

from __future__ import annotations

import pytest

from conftest import make_state, record
from transports import NoopWriter, PageTouchingWriter, ours_process, side


@pytest.fixture(scope="module", params=[256, 8192], ids=lambda n: f"{n}tensors")
def state(request, total_bytes):
    return request.param, make_state(total_bytes, request.param)


@pytest.mark.parametrize(
    ("side_name", "median_name", "rounds"), [("ours", "e2e_ours_shm", 5), ("torch", "e2e_torch", 3)]
)
def test_stage_handoff_and_writer(benchmark, state, total_bytes, side_name, median_name, rounds):
    count, sd = state
    benchmark.group = f"stage + handoff + persist: {count} tensors"
    with side(side_name, PageTouchingWriter, total_bytes + (8 << 20)) as (cp, stager):
        benchmark.pedantic(
            lambda: cp.write(stager.stage(sd), "unused").result(), rounds=rounds, warmup_rounds=2
        )
    record(benchmark, f"{median_name}_{count}", total_bytes)


def test_ours_with_plain_state_dict(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"stage + handoff + persist: {count} tensors"
    cp = ours_process(PageTouchingWriter)
    try:
        benchmark.pedantic(lambda: cp.write(sd, "unused").result(), rounds=5, warmup_rounds=2)
    finally:
        cp.close()
    record(benchmark, f"e2e_ours_plain_{count}", total_bytes)


def test_handoff_alone_ours(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"handoff alone: {count} tensors"
    with side("ours", NoopWriter, total_bytes + (8 << 20)) as (cp, stager):

        def setup():
            return (stager.stage(sd),), {}  # a fresh staged dict per round, staged untimed

        benchmark.pedantic(
            lambda staged: cp.write(staged, "unused").result(),
            setup=setup,
            rounds=20,
            warmup_rounds=2,
        )
    record(benchmark, f"handoff_ours_{count}", total_bytes)


def test_handoff_alone_torch(benchmark, state, total_bytes):
    count, sd = state
    benchmark.group = f"handoff alone: {count} tensors"
    with side("torch", NoopWriter, total_bytes) as (cp, stager):
        staged = stager.stage(sd)
        benchmark.pedantic(lambda: cp.write(staged, "unused").result(), rounds=3, warmup_rounds=1)
    record(benchmark, f"handoff_torch_{count}", total_bytes)
