"""pyshmckpt side by side with its peers: torch_checkpointing, torch's transport and DCP.

    python bench/peers.py --rounds 5                    # flat (1 GiB, 8,192 tensors) and gpt
    python bench/peers.py --states flat --gib 0.25 --rounds 3 --json peers.json

One process runs every peer on the same states, the peers interleaved (in every round each one
runs once, in an order rotated from round to round). Peers:

* ``pyshmckpt``: ``pyshmckpt.Checkpointer(root)``, defaults (safetensors files, no
  ``capacity_bytes``). Staged: ``save()`` returns. Durable: its future resolves (the checkpoint
  is committed and fsynced). Load: ``pyshmckpt.load(directory)`` and ``load(directory, into=)``.
* ``torch_checkpointing``: Meta's ``torch_checkpointing`` 0.1.1, its ``CheckpointManager`` with
  its defaults except ``LocalFileSystemStorageConfig(use_direct_io=False)`` (O_DIRECT fails on
  ext4 with EINVAL). Its ``save()`` returns while a thread still stages: staged is when
  ``with manager.lock():`` gets in (the lock it documents for guarding in-place updates of the
  state, free once staging is done); the time ``save()`` returns is reported too. It does not
  fsync: once its write future resolves, this script fsyncs every file and directory of the
  checkpoint and its parent directory, and that time counts in its durable figure. Load:
  ``manager.load(directory, into={key: None})`` (its reader maps the files: the checksum below
  reads them) and ``manager.load(directory, into=state)``.
* ``torch-exp``: torch's ``_experimental`` ``DefaultStager`` + ``CheckpointProcess`` with its own
  ``CheckpointWriter`` (``torch.save`` in the writer process), built as bench/transports.py and
  bench/training_overhead.py build it, the writer process starting in the background as with
  ``make_async_checkpointer``. Staged: the stager returns and ``write()`` has handed the state
  over. It does not fsync either: the same fsyncs are added. Load: its ``CheckpointReader``
  (``torch.load``; with a state dict, it reads each tensor into it).
* ``dcp``: ``torch.distributed.checkpoint.async_save(state, checkpoint_id=directory)`` with its
  default stager, no process group. Staged: ``async_save`` returns. DCP fsyncs its files; the
  same fsyncs as above are added for its directories. It has nothing to construct and makes a
  new stager (new memory) for every save, so its first save is an ordinary one. Load:
  ``dcp.load`` fills a state dict in place; its fresh load builds ``torch.empty`` tensors of the
  saved shapes first (inside the timing), as a caller of DCP must.

Per state and peer, a round constructs a new checkpointer, saves at once (the first save), saves
once more untimed (it warms what the first save did not touch: our second slot's pages, a buffer
made on first use), then --steady timed saves; each save starts once the previous one is durable.
Then the last checkpoint is loaded fresh and into existing tensors. Every save goes to a
directory of its own, deleted once no longer needed. A fresh load's time includes reading every
byte of what it returned (a CRC32C over each distinct storage, single-threaded, as
bench/load_speed.py does, the same for every peer); the page cache holds the files (just
written). In the first round every peer's loads are checked bitwise equal to the state (and
``into=`` filled in place), outside the timing. Medians over the rounds (steady saves: over all
of them); "x faster" = the peer's median / ours (bigger: ours is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from load_speed import gpt_state, make_flat, make_gpt, nbytes_of, read_every_byte, tensors_of

import pyshmckpt
from pyshmckpt import _torch_private

import transports  # bench/transports.py: torch's transport as every benchmark builds it

GIB = 1 << 30
MIB = 1 << 20
TIMEOUT = 600.0  # seconds any one wait may take before the run fails instead of hanging
PEERS = ("pyshmckpt", "torch_checkpointing", "torch-exp", "dcp")
ROWS = (
    ("construct", "construct"),
    ("first_returned", "first save: save() returns"),
    ("first_staged", "first save: staged"),
    ("first_durable", "first save: durable"),
    ("steady_returned", "steady save: save() returns"),
    ("steady_staged", "steady save: staged"),
    ("steady_durable", "steady save: durable"),
    ("load_fresh", "load fresh + read every byte"),
    ("load_into", "load into existing tensors"),
)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under `path`, `path` itself and its parent."""
    for directory, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(Path(directory) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for directory in [d for d, _dirs, _files in os.walk(path)] + [str(path.parent)]:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], memo: dict[int, Any]) -> Any:
    """`obj` with every tensor replaced by fn(tensor); a tensor met twice maps to one result."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = fn(obj)
        return memo[id(obj)]
    if isinstance(obj, dict):
        return {key: map_tensors(value, fn, memo) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(value, fn, memo) for value in obj)
    return obj


def expect(ok: bool, message: str) -> None:
    """A check of the results that holds under ``python -O`` too (unlike assert)."""
    if not ok:
        raise AssertionError(message)


def assert_bitwise_equal(loaded: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        expect(isinstance(loaded, torch.Tensor), f"{where}: {type(loaded)}")
        expect(loaded.shape == expected.shape, f"{where}: shape")
        expect(loaded.dtype == expected.dtype, f"{where}: dtype")
        a, b = loaded.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
        expect(torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{where}: bytes differ")
    elif isinstance(expected, dict):
        expect(isinstance(loaded, dict), f"{where}: {type(loaded)}")
        expect(set(loaded) == set(expected), f"{where}: keys")
        for key, value in expected.items():
            assert_bitwise_equal(loaded[key], value, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        expect(len(loaded) == len(expected), f"{where}: length")
        for i, (a, b) in enumerate(zip(loaded, expected, strict=True)):
            assert_bitwise_equal(a, b, f"{where}[{i}]")
    else:
        expect(loaded == expected, f"{where}: {loaded!r} != {expected!r}")


def checksum(obj: Any) -> int:
    """Reads every byte of the tensors of `obj` (CUDA ones through a host copy)."""
    if any(t.device.type != "cpu" for t in tensors_of(obj)):
        obj = map_tensors(obj, lambda t: t.cpu(), {})
    return read_every_byte(obj)


class Saving:
    """One save in flight: `staged()` waits until the state may change, `durable()` until the
    checkpoint is on disk (with the fsyncs the peer lacks)."""

    def __init__(self, staged: Callable[[], None], durable: Callable[[], None]) -> None:
        self.staged = staged
        self.durable = durable


class Peer:
    """A checkpointer of one library: save(state, directory) -> Saving; loads; close()."""

    name = ""

    def save(self, state: Any, directory: Path) -> Saving:
        raise NotImplementedError

    def load_fresh(self, directory: Path, like: Any) -> Any:
        raise NotImplementedError

    def load_into(self, directory: Path, target: Any) -> Any:
        """Fills `target`'s tensors in place; returns the loaded state (the library's return
        value: a leaf such as an int is not changed inside `target` by every library)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Ours(Peer):
    name = "pyshmckpt"

    def __init__(self, root: Path, device: str) -> None:
        self.checkpointer = pyshmckpt.Checkpointer(root)
        self.device = device

    def save(self, state: Any, directory: Path) -> Saving:
        future = self.checkpointer.save(state, directory.name)
        return Saving(lambda: None, lambda: future.result(timeout=TIMEOUT))

    def load_fresh(self, directory: Path, like: Any) -> Any:
        return pyshmckpt.load(directory, map_location=self.device)

    def load_into(self, directory: Path, target: Any) -> Any:
        return pyshmckpt.load(directory, into=target)

    def close(self) -> None:
        self.checkpointer.close()


class TorchCheckpointing(Peer):
    name = "torch_checkpointing"

    def __init__(self, root: Path, device: str) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        storage = LocalFileSystemStorageConfig(use_direct_io=False)
        self.manager = CheckpointManager(CheckpointManager.Config(storage_config=storage))
        self.device = device

    def save(self, state: Any, directory: Path) -> Saving:
        future = self.manager.save(str(directory), state)
        expect(future is not None, "torch_checkpointing's save() gave no write future")

        def staged() -> None:
            with self.manager.lock():  # free once staging is done (acquire bounded: 600 s)
                pass

        def durable() -> None:
            future.result(timeout=TIMEOUT)
            fsync_tree(directory)

        return Saving(staged, durable)

    def load_fresh(self, directory: Path, like: Any) -> Any:
        return dict(
            self.manager.load(str(directory), into=dict.fromkeys(like), map_location=self.device)
        )

    def load_into(self, directory: Path, target: Any) -> Any:
        return self.manager.load(str(directory), into=target)

    def close(self) -> None:
        self.manager.close()


class TorchExperimental(Peer):
    name = "torch-exp"

    def __init__(self, root: Path, device: str) -> None:
        writer = _torch_private.experimental("checkpoint_writer", "CheckpointWriter")
        config = _torch_private.experimental("checkpoint_writer", "CheckpointWriterConfig")
        self.process = transports.torch_process(writer, {"config": config()}, started=False)
        self.stager = transports.torch_stager()
        reader = _torch_private.experimental("checkpoint_reader", "CheckpointReader")
        self.reader = reader(transports.RANK)
        self.device = device

    def save(self, state: Any, directory: Path) -> Saving:
        future = self.process.write(self.stager.stage(state), str(directory))

        def durable() -> None:
            future.result(timeout=TIMEOUT)
            fsync_tree(directory)

        return Saving(lambda: None, durable)

    def load_fresh(self, directory: Path, like: Any) -> Any:
        return self.reader.read(str(directory), map_location=self.device)[0]

    def load_into(self, directory: Path, target: Any) -> Any:
        return self.reader.read(str(directory), target)[0]

    def close(self) -> None:
        try:
            self.process.close()
        finally:
            self.stager.close()


class Dcp(Peer):
    name = "dcp"

    def __init__(self, root: Path, device: str) -> None:
        self.device = device

    def save(self, state: Any, directory: Path) -> Saving:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled" and the like
            pending = dcp.async_save(state, checkpoint_id=str(directory))
        future = getattr(pending, "upload_completion", pending)

        def durable() -> None:
            future.result(timeout=TIMEOUT)
            fsync_tree(directory)

        return Saving(lambda: None, durable)

    def load_fresh(self, directory: Path, like: Any) -> Any:
        target = map_tensors(like, lambda t: torch.empty_like(t, device=self.device), {})
        self.load_into(directory, target)
        return target

    def load_into(self, directory: Path, target: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, checkpoint_id=str(directory))
        return target


PEER_CLASSES: dict[str, type[Peer]] = {
    cls.name: cls for cls in (Ours, TorchCheckpointing, TorchExperimental, Dcp)
}


def timed_save(peer: Peer, state: Any, directory: Path) -> dict[str, float]:
    started = time.perf_counter()
    saving = peer.save(state, directory)
    returned = time.perf_counter()
    saving.staged()
    staged = time.perf_counter()
    saving.durable()
    durable = time.perf_counter()
    return {
        "returned": returned - started,
        "staged": staged - started,
        "durable": durable - started,
    }


@contextlib.contextmanager
def scratch(parent: str | None) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="peers-", dir=parent))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def one_round(
    name: str,
    state: Any,
    make_target: Callable[[], Any],
    args: argparse.Namespace,
    check: bool,
    times: dict[str, list[float]],
) -> None:
    """Construct `name`'s checkpointer, first save, steady saves, both loads; into `times`."""
    with scratch(args.dir) as root:
        started = time.perf_counter()
        peer = PEER_CLASSES[name](root / "checkpoints", args.device)
        times["construct"].append(time.perf_counter() - started)
        try:
            (root / "checkpoints").mkdir(exist_ok=True)
            last = root / "checkpoints" / "save-0"
            first = timed_save(peer, state, last)
            for key in ("returned", "staged", "durable"):
                times[f"first_{key}"].append(first[key])
            # the second save warms what the first did not touch (our second slot's pages, a
            # staging buffer made on first use); it is not counted
            for i in range(1, args.steady + 2):
                shutil.rmtree(last)
                last = root / "checkpoints" / f"save-{i}"
                steady = timed_save(peer, state, last)
                for key in ("returned", "staged", "durable"):
                    if i > 1:
                        times[f"steady_{key}"].append(steady[key])
            if check:
                assert_bitwise_equal(peer.load_fresh(last, state), state, name)
            started = time.perf_counter()
            checksum(peer.load_fresh(last, state))
            times["load_fresh"].append(time.perf_counter() - started)
            target = make_target()
            started = time.perf_counter()
            loaded = peer.load_into(last, target)
            times["load_into"].append(time.perf_counter() - started)
            if check:
                assert_bitwise_equal(loaded, state, f"{name} into")
                expect(
                    all(
                        a is b for a, b in zip(tensors_of(loaded), tensors_of(target), strict=True)
                    ),
                    f"{name} into: not filled in place",
                )
            del target, loaded
        finally:
            peer.close()


def build_state(kind: str, args: argparse.Namespace) -> tuple[Any, Callable[[], Any]]:
    """(state, make_target): the state saved, and a new state of its structure to load into."""
    if kind == "flat":
        total = int(args.gib * GIB) // 4096 * 4096

        state: Any = {"model": make_flat(total, args.tensors), "step": 1}

        def make_target() -> Any:
            return {"model": {k: torch.zeros_like(t) for k, t in state["model"].items()}, "step": 0}
    else:
        state = gpt_state(*make_gpt())

        def make_target() -> Any:
            return gpt_state(*make_gpt(seed=1))

    if args.device == "cpu":
        return state, make_target

    def to_device(obj: Any) -> Any:
        return map_tensors(obj, lambda t: t.to(args.device), {})

    return to_device(state), lambda: to_device(make_target())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--states", nargs="+", default=["flat", "gpt"], choices=("flat", "gpt"))
    parser.add_argument("--gib", type=float, default=1.0, help="flat state size (default 1)")
    parser.add_argument("--tensors", type=int, default=8192, help="flat state tensors")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steady", type=int, default=2, help="saves after the first, per round")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    # raised on DCP's and torch's threads too, where a catch_warnings() does not reach
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    free = shutil.disk_usage(args.dir or tempfile.gettempdir()).free
    if free < 4 * args.gib * GIB:
        raise SystemExit(f"{free / GIB:.1f} GiB free where checkpoints go: too little")
    results: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
        "states": {},
    }
    for kind in args.states:
        state, make_target = build_state(kind, args)
        size, count = nbytes_of(state), len(tensors_of(state))
        times: dict[str, dict[str, list[float]]] = {
            name: {row: [] for row, _ in ROWS} for name in args.peers
        }
        for r in range(args.rounds):
            order = args.peers[r % len(args.peers) :] + args.peers[: r % len(args.peers)]
            for name in order:
                one_round(name, state, make_target, args, r == 0, times[name])
                # a closed peer's shared storages hold a descriptor each until collected: 8,192
                # tensors per peer would reach the open-file limit within a few rounds
                gc.collect()
                print(
                    f"{kind} round {r} {name:20s} "
                    + " ".join(f"{row}={ts[-1] * 1e3:.0f}" for row, ts in times[name].items())
                    + f" loadavg={Path('/proc/loadavg').read_text().split()[0]}"
                    + f" fds={sum(1 for _ in Path('/proc/self/fd').iterdir())}",
                    flush=True,
                )
        medians = {
            name: {row: statistics.median(ts) for row, ts in rows.items()}
            for name, rows in times.items()
        }
        report(kind, size, count, args, medians)
        results["states"][kind] = {
            "bytes": size, "tensors": count, "medians_s": medians, "times_s": times,
        }  # fmt: skip
        del state
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


def report(
    kind: str, size: int, count: int, args: argparse.Namespace, medians: dict[str, Any]
) -> None:
    print(
        f"\n{kind}: {size / MIB:.0f} MiB in {count} tensors, {args.device}, medians of "
        f"{args.rounds} rounds (steady: {args.rounds * args.steady} saves); ms, and x faster = "
        "peer / pyshmckpt"
    )
    header = f"{'':30s}" + "".join(f"{name:>22s}" for name in args.peers)
    print(header)
    for row, label in ROWS:
        cells = []
        for name in args.peers:
            ms = medians[name][row] * 1e3
            cell = f"{ms:.0f}"
            if name != "pyshmckpt" and "pyshmckpt" in medians and row != "construct":
                cell += f" ({medians[name][row] / medians['pyshmckpt'][row]:.2f}x)"
            cells.append(f"{cell:>22s}")
        print(f"{label:30s}" + "".join(cells))


if __name__ == "__main__":
    main()
