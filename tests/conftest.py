"""Shared fixtures: the shared-memory leak check, GPU skipping, and small state dicts (and, from
`s3servers` and `gcsservers`, an S3 API server, a Google Cloud Storage API server and a bucket
per test)."""

from __future__ import annotations

import copy
import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.register_assert_rewrite("helpers")  # its checks must hold under python -O too
pytest_plugins = ["s3servers", "gcsservers"]  # the object storage tests' servers and buckets

import pyshmckpt  # noqa: E402

from helpers import SAVE_TIMEOUT, gpt_state, opened, snapshot  # noqa: E402

SHM = Path("/dev/shm")
# Segments made through the Python layer in this session (children inherit the variable), so that
# concurrent test sessions never count or remove each other's segments.
SESSION_PREFIX = f"pyshmckpt-t{os.getpid()}"
os.environ["PYSHMCKPT_SEGMENT_PREFIX"] = SESSION_PREFIX
# A writer whose trainer died holds the newest checkpoint in memory for a new trainer (the memory
# tier): for 0 s in the tests of everything else, which wait for such writers to exit; the tests
# of the memory tier pass their own hold timeout.
os.environ["PYSHMCKPT_HOLD_TIMEOUT"] = "0"
# Without credentials, cloud clients ask a metadata server (169.254.169.254) for some: the tests'
# traffic stays on this machine.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ["NO_GCE_CHECK"] = "True"
os.environ["GCE_METADATA_HOST"] = os.environ["GCE_METADATA_IP"] = "127.0.0.1:9"
# Segments made directly with the native default prefix by this process.
DIRECT_PREFIX = f"pyshmckpt-{os.getpid()}-"


def our_segments() -> set[str]:
    """Names of this test session's segments in /dev/shm."""
    return {
        p.name
        for p in SHM.iterdir()
        if p.name.startswith(SESSION_PREFIX + "-") or p.name.startswith(DIRECT_PREFIX)
    }


def pytest_configure(config: pytest.Config) -> None:
    share_optimized_bytecode(config)


def share_optimized_bytecode(config: pytest.Config) -> None:
    """Let the processes the tests start reuse one cache of ``.opt-N.pyc`` files under ``python -O``.

    pip writes only unoptimized bytecode, so with ``PYTHONDONTWRITEBYTECODE`` set every writer
    process and script of an ``-O`` run would compile torch from source again (about 1.5 s each,
    half the ``-O`` pass). A cache under ``.pytest_cache`` changes no behaviour: the flags stay.
    """
    if not sys.flags.optimize or config.cache is None:
        return
    if "PYTHONPYCACHEPREFIX" not in os.environ:
        os.environ["PYTHONPYCACHEPREFIX"] = str(
            config.cache.mkdir(f"pycache-opt{sys.flags.optimize}")
        )
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = spread_slow_tests(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    if pyshmckpt.cuda_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device (pyshmckpt cuda-info says why CUDA is not usable here)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def spread_slow_tests(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """The tests in the order that keeps `workers` xdist workers busy to the end.

    Work stealing (pyproject.toml) first hands worker w the contiguous share
    ``[w * n // workers, (w + 1) * n // workers)`` of the list, runs each share from its head, and
    steals from a share's tail: so each share starts with its part of the slow tests (dealt in
    turn) and is filled up with the others in their order. Slow tests bunched in one share would
    run one after another on one worker while the others ran out of work."""
    slow = [item for item in items if "slow" in item.keywords]
    rest = iter(item for item in items if "slow" not in item.keywords)
    n = len(items)
    ordered: list[pytest.Item] = []
    for w in range(workers):
        share = slow[w::workers]
        size = (w + 1) * n // workers - w * n // workers
        ordered += share + list(itertools.islice(rest, max(0, size - len(share))))
    return ordered + list(rest)


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Fail any test that leaves a segment of ours in /dev/shm (checked after the test)."""
    import gc

    before = our_segments()
    yield
    leaked = our_segments() - before
    if leaked:
        gc.collect()  # objects that only a reference cycle kept alive
        leaked = our_segments() - before
    if leaked:
        for name in leaked:  # do not let one leak fail every later test
            (SHM / name).unlink(missing_ok=True)
        pytest.fail(f"test left shared-memory segments behind: {sorted(leaked)}")


@pytest.fixture(autouse=True)
def torch_determinism_restored():
    """Put torch's deterministic-algorithms mode back after each test: a Lightning Trainer made
    with ``deterministic=True`` turns it on for the whole process, and with it on, later tests'
    ``torch.empty`` of some dtypes (bits8) raises."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


@pytest.fixture
def stager():
    s = pyshmckpt.ShmStager(slot_timeout=0.5)
    yield s
    s.close()


class TinyGPT(torch.nn.Module):
    """A small decoder-only transformer with tied input/output embeddings."""

    def __init__(self, vocab: int = 97, dim: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(64, dim) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 97, (4, 16), generator=g)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 97), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach().item()


@pytest.fixture
def trained():
    """A TinyGPT and its AdamW optimizer after one step: a realistic model + optimizer state."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optimizer)
    return model, optimizer


# -- a Checkpointer and a checkpoint shared by the tests of a module -------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pyshmckpt.Checkpointer]:
    """One Checkpointer for the tests that do not need a root of their own. Its arena is
    allocated here (capacity given), so no test creates a segment through it."""
    root = tmp_path_factory.mktemp("shared-root")
    with opened(root, capacity_bytes=8 << 20) as ck:
        yield ck


@pytest.fixture(scope="module")
def gpt_checkpoint(shared: pyshmckpt.Checkpointer) -> dict[str, Any]:
    """A TinyGPT + AdamW (after one step) saved once through the safetensors writer.

    Returns the committed path, the state as it was at save time (cloned), and deep copies of
    the model and optimizer taken before saving (to continue training from)."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optimizer)
    state = gpt_state(model, optimizer)
    expected = snapshot(state)
    reference = copy.deepcopy((model, optimizer))  # together: the optimizer keeps its params
    path = shared.save(state, name="gpt").result(timeout=SAVE_TIMEOUT)
    return {"path": path, "expected": expected, "reference": reference}
