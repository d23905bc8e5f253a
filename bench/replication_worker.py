"""One rank of bench/replication.py: torchrun on two simulated nodes, one rank each (gloo, CPU).

    replication_worker.py replicate OUT     # throughput, then (with "restore") the restore
    replication_worker.py train OUT         # training with and without replication

OUT/params.json holds the parameters (written by the driver); BENCH_NODE says which node this
rank runs on (ranks may change nodes between attempts: everything here goes by node). Results
are written by the rank on node 0 (OUT/throughput.json, OUT/training.json) or by each rank
(OUT/restore-node<N>.json). Checkpoint collectives use a gloo group of their own.

``replicate``, first attempt: a flat state of ``bytes`` in ``tensors`` float32 tensors;
``Checkpointer(root, replicate=True)``; each repeat runs, in a rotating order:

* raw one way       node 0 sends ``bytes`` over plain TCP to node 1 (``sendfile`` from a file in
                    its /dev/shm; node 1 ``recv_into`` a buffer allocated and faulted in before);
                    seconds from the first byte sent to node 1's one-byte acknowledgement
* replica one way   node 0's ``save(state, persist=False)``: seconds from save() returning
                    (staged) to its Future resolving (held and checked on node 1); node 1's
                    rank then checks that its node holds that replica
* raw both ways, replica both ways: the same from both nodes at once

With ``restore``, both ranks then save ``persisted`` (on disk, held, replicated), write
OUT/saved-node<N>.json and wait: the driver replaces node 1 (``fail(); up()``) and starts its
torchrun again; node 0's rank fails in a barrier and exits as a crashed trainer (its writer holds
its checkpoint and node 1's replica while its torchrun agent lives), and the agent restarts it
(``--max-restarts 1``). The restarted ranks then time ``pyshmckpt.load(root)`` (node 1's rank
fetches its checkpoint from node 0's memory: checked in the log) and ``load(root,
source="disk")`` in a rotating order, each after ``sync`` and dropping the page cache (when
``drop_caches``), with the files this process maps (torch's libraries) read again afterwards,
so that the checkpoint's pages alone are cold.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import logging
import mmap
import os
import socket
import struct
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import pyshmckpt
from pyshmckpt.cli.demo import gpt
from pyshmckpt.errors import ReplicationWarning
from pyshmckpt.storage import reader  # noqa: F401
from pyshmckpt.tiers import loading, peer_restore, replicas, restore, wire  # noqa: F401

# Imported above, not by the first timed load: pyshmckpt.load imports its modules lazily.

TIMEOUT = 600.0  # seconds one save, load or transfer may take
HANG_TIMEOUT = 1500  # seconds after which a rank prints every thread's stack and exits
THROUGHPUT_MODES = ("raw one way", "replica one way", "raw both ways", "replica both ways")
SOURCES = ("peer", "disk")  # load(root) on a replaced node, and load(root, source="disk")
CHUNK = 16 << 20


def write_json(path: Path, data: Any) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(data))
    path.with_suffix(".tmp").replace(path)


def gather(value: Any) -> list[Any]:
    """`value` of every rank (over the default group), by rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def replication_failures(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ReplicationWarning)]


# -- raw TCP between the two nodes ----------------------------------------------------------


def _timeouts(sock: socket.socket) -> None:
    """A blocking socket whose every send and receive is bounded by TIMEOUT in the kernel (a
    Python-level timeout would make the descriptor non-blocking: more system calls)."""
    sock.settimeout(None)
    seconds = struct.pack("ll", int(TIMEOUT), 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, seconds)


class RawLink:
    """Plain TCP between the ranks: each listens on its node's address (the one replicas use)."""

    def __init__(self, prefix: str, rank: int) -> None:
        self.listener = socket.create_server((wire.node_address(), 0))
        self.listener.settimeout(TIMEOUT)
        self.addresses = gather(self.listener.getsockname()[:2])
        self.source = Path("/dev/shm") / f"{prefix}-rawtcp-{rank}"

    def run(self, nbytes: int, send_to: int | None, receive: bool) -> float | None:
        """One transfer of `nbytes`: to rank `send_to` (None: none) and from the other rank
        (`receive`), at once after a barrier; the seconds of the send, or None."""
        fd, buffer, errors = None, None, []
        thread = None
        try:
            if send_to is not None:  # a file in /dev/shm, written (not sparse): real pages
                fd = os.open(self.source, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                self.source.unlink()  # nothing left behind whatever happens
                pattern = bytes(range(256)) * (CHUNK // 256)
                for offset in range(0, nbytes, CHUNK):
                    os.write(fd, pattern[: min(CHUNK, nbytes - offset)])
            if receive:
                flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
                buffer = mmap.mmap(-1, nbytes, flags=flags)  # allocated and faulted in
                thread = threading.Thread(target=self._receive, args=(buffer, errors))
                thread.start()
            dist.barrier()
            seconds = self._send(self.addresses[send_to], fd, nbytes) if fd is not None else None
            if thread is not None:
                thread.join(TIMEOUT)
                if thread.is_alive() or errors:
                    raise SystemExit(f"raw TCP receive failed: {errors or 'timed out'}")
            dist.barrier()
            return seconds
        finally:
            if fd is not None:
                os.close(fd)
            if buffer is not None:
                buffer.close()

    def _receive(self, buffer: mmap.mmap, errors: list[BaseException]) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn, memoryview(buffer) as view:
                _timeouts(conn)
                got = 0
                while got < len(view):
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError(f"closed after {got} of {len(view)} bytes")
                    got += n
                conn.sendall(b"k")
        except BaseException as exc:  # noqa: BLE001 - reported by `run`
            errors.append(exc)

    @staticmethod
    def _send(address: tuple[str, int], fd: int, nbytes: int) -> float:
        with socket.create_connection(address, timeout=TIMEOUT) as sock:
            _timeouts(sock)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            started = time.perf_counter()
            sent = 0
            while sent < nbytes:
                n = os.sendfile(sock.fileno(), fd, sent, nbytes - sent)
                if n == 0:
                    raise SystemExit("raw TCP: the receiver closed the connection")
                sent += n
            if sock.recv(1) != b"k":
                raise SystemExit("raw TCP: no acknowledgement from the receiver")
            return time.perf_counter() - started

    def close(self) -> None:
        self.listener.close()


# -- replication throughput, then the persisted save the restore starts from --------------------


def flat_state(nbytes: int, tensors: int, rank: int) -> dict[str, Any]:
    numel = nbytes // 4 // tensors
    state: dict[str, Any] = {
        f"layers.{i}.weight": torch.arange(numel, dtype=torch.float32).add_(i + rank * tensors)
        for i in range(tensors)
    }
    state["step"] = 7
    return state


def replicate_first(params: dict[str, Any], out: Path, node: int, group: Any) -> None:
    rank = dist.get_rank()
    nodes = gather(node)
    other = nodes.index(1 - node)  # the rank on the other node: this rank's buddy
    root = os.path.realpath(params["root"])
    nbytes, tensors = params["bytes"], params["tensors"]
    state = flat_state(nbytes, tensors, rank)
    link = RawLink(params["prefix"], rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointer = pyshmckpt.Checkpointer(
            root, process_group=group, replicate=True, hold_timeout=params["hold_timeout"],
            barrier_timeout=TIMEOUT,
        )  # fmt: skip

        def replicate(
            name: str, saving_of: list[bool], persist: bool = False
        ) -> tuple[float, float]:
            """Save `name` on the ranks `saving_of` says; this rank's (staging, replication)
            seconds (NaN where it does not save). Checks that this node holds the other
            rank's replica."""
            dist.barrier()
            stage = replicated = float("nan")
            if saving_of[rank]:
                started = time.perf_counter()
                future = checkpointer.save(state, name=name, persist=persist)
                returned = time.perf_counter()
                future.result(TIMEOUT)
                stage, replicated = returned - started, time.perf_counter() - returned
                if failed := replication_failures(caught):
                    raise SystemExit(f"rank {rank}: {name} was not replicated: {failed}")
            dist.barrier()
            if saving_of[other]:
                held = replicas.find(root, other)
                if held is None or held.get("name") != name:
                    raise SystemExit(f"node {node} holds no replica of {name} from rank {other}")
            return stage, replicated

        everyone = [True] * len(nodes)
        if params["throughput"]:  # warm-ups, untimed: both ways
            link.run(nbytes, other, True)
            replicate("warmup", everyone)
        rows = []
        for repeat in range(params["repeats"] if params["throughput"] else 0):
            shift = repeat % len(THROUGHPUT_MODES)
            for mode in THROUGHPUT_MODES[shift:] + THROUGHPUT_MODES[:shift]:
                both = mode.endswith("both ways")
                saving_of = [both or n == 0 for n in nodes]
                if mode.startswith("raw"):
                    seconds = link.run(nbytes, other if saving_of[rank] else None, saving_of[other])
                    stage = None
                else:
                    name = f"{mode.replace(' ', '-')}-{repeat}"
                    stage, seconds = replicate(name, saving_of)
                    if not saving_of[rank]:
                        stage = seconds = None
                timed = gather((node, seconds, stage))
                rows.append({
                    "mode": mode, "repeat": repeat,
                    "seconds": {str(n): s for n, s, _ in timed if s is not None},
                    "stage_seconds": {str(n): s for n, _, s in timed if s is not None},
                })  # fmt: skip
        link.close()
        if node == 0 and params["throughput"]:
            suite = wire.suites()[0]  # what both ends choose: they share this environment
            write_json(out / "throughput.json", {"bytes": nbytes, "rows": rows, "suite": suite})
        if not params["restore"]:
            checkpointer.close()
            dist.barrier()
            return
        replicate("persisted", everyone, persist=True)
    write_json(out / f"saved-node{node}.json", {"rank": rank})
    if node == 1:
        time.sleep(TIMEOUT)  # until the driver replaces this node
        raise SystemExit("node 1 was not replaced")
    try:
        dist.barrier()  # fails once node 1 is gone, as a survivor's collective does
    except Exception as exc:  # noqa: BLE001 - the point: this rank dies now
        print(f"node 1 is gone ({exc}); exiting as a crashed trainer", file=sys.stderr, flush=True)
        os._exit(1)
    raise SystemExit("passed a barrier with node 1 gone")


# -- the restore on the replaced node --------------------------------------------------------


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def where_from(messages: list[str]) -> str:
    """Where the restore log says this rank's checkpoint came from."""
    if any("from the memory of rank" in m for m in messages):
        return "peer"
    if any(m.startswith("restoring") and m.endswith("from memory") for m in messages):
        return "memory"
    return "disk"


def rewarm(skip: str) -> None:
    """Read every file this process maps (its libraries) once more, except under `skip`: after
    the page cache is dropped, only the checkpoint's pages stay cold, as on a node that has
    imported torch but never read the checkpoint."""
    paths = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith("(deleted)"):
            if not fields[5].startswith(("/dev/", skip)):
                paths.add(fields[5])
    for path in paths:
        try:
            with Path(path).open("rb") as f:
                while f.read(CHUNK):
                    pass
        except OSError:
            continue


def restore_again(params: dict[str, Any], out: Path, node: int, group: Any) -> None:
    root = os.path.realpath(params["root"])
    expected = params["bytes"] // 4 // params["tensors"] * 4 * params["tensors"]
    messages = Messages()
    restore_log = logging.getLogger("pyshmckpt.tiers.restore")
    restore_log.addHandler(messages)
    restore_log.setLevel(logging.INFO)
    rows = []
    for repeat in range(params["repeats"]):
        shift = repeat % len(SOURCES)
        for source in SOURCES[shift:] + SOURCES[:shift]:
            dist.barrier()
            if params["drop_caches"]:
                if node == 1:  # the page cache is the machine's: one rank drops it
                    os.sync()
                    Path("/proc/sys/vm/drop_caches").write_text("3\n")
                dist.barrier()
                rewarm(root)
            dist.barrier()
            messages.seen.clear()
            started = time.perf_counter()
            state = pyshmckpt.load(
                root, process_group=group, source="disk" if source == "disk" else "auto"
            )
            seconds = time.perf_counter() - started
            got = sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
            if got != expected or state.get("step") != 7:
                raise SystemExit(f"node {node}: {source} restored {got} bytes, not {expected}")
            came = where_from(messages.seen)
            wanted = "disk" if source == "disk" else ("peer" if node == 1 else "memory")
            if came != wanted:
                raise SystemExit(
                    f"node {node}: load for {source} came from {came}, not {wanted}: "
                    f"{messages.seen}"
                )
            rows.append({"source": source, "repeat": repeat, "seconds": seconds, "from": came})
            del state
            gc.collect()
    write_json(out / f"restore-node{node}.json", {"rows": rows})
    dist.barrier()


# -- training with checkpoints in memory, replicated or not -----------------------------------


def train(params: dict[str, Any], out: Path, node: int, group: Any) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = gpt.GPTConfig(
        vocab=params["vocab"], seq_len=params["seq_len"], width=params["width"],
        layers=params["layers"], heads=8,
    )  # fmt: skip
    cases = [("none", 0)] + [(way, n) for n in params["every"] for way in ("memory", "replicated")]
    runs = []
    for repeat in range(params["repeats"]):
        shift = repeat % len(cases)
        for way, every in cases[shift:] + cases[:shift]:
            root = Path(params["root"]) / f"{way}-{every}-{repeat}"
            seconds = max(gather(run_training(params, config, way, every, root, group)))
            runs.append({"way": way, "every": every, "repeat": repeat, "seconds": seconds})
            if node == 0:
                print(f"repeat {repeat} {way:10s} every {every:3d}: {seconds:.2f} s", flush=True)
    if node == 0:
        write_json(out / "training.json", {"runs": runs, "world_size": world, "rank": rank})
    dist.barrier()


def run_training(
    params: dict[str, Any], config: gpt.GPTConfig, way: str, every: int, root: Path, group: Any
) -> float:
    """Wall seconds of this rank's training steps, saving every `every` steps (`way`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = gpt.GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parameters = list(model.parameters())
    checkpointer = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if way != "none":
            checkpointer = pyshmckpt.Checkpointer(
                root, process_group=group, replicate=way == "replicated", hold_timeout=60,
                barrier_timeout=TIMEOUT,
            )  # fmt: skip
            checkpointer.wait_for_writer(TIMEOUT)  # started at set-up, as a job does
        try:
            dist.barrier()
            started = time.perf_counter()
            pending = None
            for step in range(1, params["steps"] + 1):
                inputs, targets = gpt.batch(
                    step, params["batch_size"], config.seq_len, config.vocab, seed=rank
                )
                optimizer.zero_grad(set_to_none=True)
                model.loss(inputs, targets).backward()
                grads = torch.cat([p.grad.reshape(-1) for p in parameters])
                dist.all_reduce(grads)  # data parallel: the mean gradient of both ranks
                grads /= world
                offset = 0
                for p in parameters:
                    p.grad.copy_(grads[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
                optimizer.step()
                if checkpointer is not None and step % every == 0:
                    if pending is not None:
                        pending.result(TIMEOUT)  # one checkpoint in flight
                    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
                    pending = checkpointer.save(state, persist=False)
            if pending is not None:
                pending.result(TIMEOUT)
            seconds = time.perf_counter() - started
            dist.barrier()  # the other rank's last replica has arrived here too
        finally:
            if checkpointer is not None:
                checkpointer.close()
        if failed := replication_failures(caught):
            raise SystemExit(f"rank {rank}: a checkpoint was not replicated: {failed}")
    return seconds


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    params = json.loads((out / "params.json").read_text())
    faulthandler.dump_traceback_later(HANG_TIMEOUT, exit=True)  # a hang fails with its stacks
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    node = int(os.environ["BENCH_NODE"])
    group = dist.new_group(backend="gloo")  # checkpoint collectives never meet the others
    if mode == "train":
        train(params, out, node, group)
    # A replaced node's new agent counts from 0: the restart is what any rank's count says.
    elif max(gather(int(os.environ["TORCHELASTIC_RESTART_COUNT"]))) == 0:
        replicate_first(params, out, node, group)
    else:
        restore_again(params, out, node, group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
