"""The writer's replication, with real sockets and processes on loopback: of the copies of one
rank the one staged last is kept, whatever the order they arrive in and whichever process of
the node holds the other; a silent, trickling or stopped buddy costs a save a bounded time,
well under the writer's stall timeout, while progress is reported as bytes move, and a buddy
that failed is not tried again at once; the server keeps every replica's segment open while it
holds it, and closes it once the replica is freed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from peers import TIMEOUT, held_checkpoint

from pyshmckpt.shm.stale import SHM_DIR
from pyshmckpt.storage import progress
from pyshmckpt.tiers import records, replicas, replication, topology, wire
from pyshmckpt.tiers.replication import ReplicaConfig, ReplicaServer, Replication

from helpers import child_env, wait_until

pytestmark = pytest.mark.timeout(120)

SECRET = wire.new_secret()
VALUES = np.arange(1 << 14, dtype=np.float32)


def config(
    buddy: tuple[str, int] | None = None,
    *,
    listen: tuple[str, int] = ("127.0.0.1", 1),
    stall: float | None = None,
    timeout: float = TIMEOUT,
) -> ReplicaConfig:
    return ReplicaConfig(listen, buddy, 1, SECRET, timeout, 0.0, None, stall_timeout=stall)


@contextlib.contextmanager
def replica_server() -> Iterator[ReplicaServer]:
    """A replica server on a loopback port reserved as a trainer reserves it."""
    reserved = topology.reserve_port("127.0.0.1")
    server = ReplicaServer(config(listen=("127.0.0.1", reserved.getsockname()[1])))
    try:
        yield server
    finally:
        server.release_all()
        reserved.close()


def send(server: ReplicaServer, record: dict) -> str | None:
    """Replicate `record` to `server` as a writer does; None, or why it failed."""
    return Replication(config(server.config.listen), record).wait()


def test_the_copy_staged_last_is_kept_whatever_the_order_of_arrival():
    with replica_server() as server:
        with held_checkpoint(VALUES, "s20", 20) as record:
            assert send(server, record) is None
        with held_checkpoint(VALUES, "s10", 10) as record:  # an older copy, arriving late
            failed = send(server, record)
        assert failed is not None
        assert "staged after 's10'" in failed
        assert replicas.find("/r", 2)["name"] == "s20"
        with held_checkpoint(VALUES, "s30", 30) as record:
            assert send(server, record) is None
        assert replicas.find("/r", 2)["name"] == "s30"
        assert [r["name"] for _, r in replicas.replicas_of("/r", 2)] == ["s30"]


HOLDER = textwrap.dedent(
    """
    # A writer of this node whose trainer died, holding a replica of its own.
    import json, sys
    from pyshmckpt import knobs
    from pyshmckpt.shm.native import Segment
    from pyshmckpt.tiers import records, replicas

    record = json.loads(sys.argv[1])
    segment = Segment.create(1 << 16, knobs.segment_prefix(), True)
    record["segment"] = {
        "name": segment.name, "size": segment.size, "token": segment.token.hex(),
        "offset": segment.data_offset,
    }
    record["replica"] = True
    path = replicas.replica_path(record["root"], record["rank"])
    records.publish(record, 0, None, None, path)
    print(segment.name, flush=True)
    sys.stdin.readline()
    if path.exists():
        records.release(path, record)
    segment.disown()
    segment.close()
    """
)


@contextlib.contextmanager
def other_holder(record: dict, name: str, staged_ns: int) -> Iterator[str]:
    """Another process of this node holding a replica of `record`'s rank; its segment's name."""
    sent = {k: v for k, v in record.items() if k not in ("segment", "holder", "agent", "deadline")}
    sent.update(name=name, staged_ns=staged_ns)
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, json.dumps(sent)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env=child_env(), cwd="/",  # not the checkout
    ) as process:  # fmt: skip
        try:
            yield process.stdout.readline().strip()
        finally:
            process.stdin.close()
            try:
                process.wait(TIMEOUT)
            finally:
                process.kill()


def test_a_copy_older_than_one_another_process_holds_is_dropped():
    with replica_server() as server, held_checkpoint(VALUES, "s40", 40) as record:
        with other_holder(record, "s50", 50) as theirs:
            failed = send(server, record)
            assert failed is not None
            assert "'s50', staged after 's40'" in failed
            assert replicas.find("/r", 2)["name"] == "s50"
            with held_checkpoint(VALUES, "s60", 60) as newer:
                assert send(server, newer) is None
            assert replicas.find("/r", 2)["name"] == "s60"
            assert not (SHM_DIR / theirs).exists()  # the older copy was freed


def test_a_silent_buddy_costs_a_save_under_half_the_stall_timeout():
    """A buddy whose kernel accepts connections that nothing answers (a stopped or hung
    writer): the save's replication gives up after half the stall timeout (1 s here), and the
    next save does not try it again at once."""
    with socket.create_server(("127.0.0.1", 0)) as silent, held_checkpoint(VALUES) as record:
        buddy = silent.getsockname()[:2]
        started = time.monotonic()
        failed = Replication(config(buddy, stall=2.0), record).wait()
        took = time.monotonic() - started
        assert failed is not None
        assert "ReplicationError" in failed
        assert took < 1.8, took
        started = time.monotonic()
        skipped = Replication(config(buddy, stall=2.0), record).wait()
        assert skipped is not None
        assert "was not tried: it failed 1 time(s) in a row" in skipped
        assert time.monotonic() - started < 0.5


def test_a_trickling_buddy_is_bounded_overall_while_progress_is_reported():
    """A buddy that authenticates, then reads slowly (under 5 MiB/s, in small pieces through a
    small receive buffer, so the window opens a little at a time): the bytes move (the writer
    reports progress as they do, so it is not taken for stalled), and the replication ends at
    its timeout, not when the 32 MiB are through."""
    reserved = socket.create_server(("127.0.0.1", 0))
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # accepted ones inherit it
    address = reserved.getsockname()[:2]
    done = threading.Event()

    def trickle(channel: wire.Channel) -> None:
        channel.recv_message(wire.Deadline(TIMEOUT))
        channel.sock.settimeout(1.0)
        while not done.wait(0.01):
            with contextlib.suppress(OSError):
                if not channel.sock.recv(48 << 10):
                    return

    listener = wire.Listener(
        reserved, SECRET, wire.identity("replicas", address=address), trickle, name="trickle"
    )
    try:
        with held_checkpoint(np.arange(8 << 20, dtype=np.float32)) as record:  # 32 MiB
            before = progress.current()
            started = time.monotonic()
            failed = Replication(config(address, stall=10.0, timeout=3.0), record).wait()
            took = time.monotonic() - started
            after = progress.current()
    finally:
        done.set()
        listener.close(TIMEOUT)
    assert failed is not None
    assert "within 3 s" in failed
    assert 2.5 < took < 6, took
    assert after[0] > before[0]  # bytes moved, and said so
    assert after[1] > before[1] + 2, (before, after)  # more than once


STOPPABLE = textwrap.dedent(
    """
    # A buddy's writer: a replica server, until stdin closes.
    import sys
    from pyshmckpt.tiers import replication
    from pyshmckpt.tiers.replication import ReplicaConfig

    host, port, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    config = ReplicaConfig((host, port), None, None, secret, 30.0, 0.0, None)
    replication.listen(config)
    print("listening", flush=True)
    sys.stdin.readline()
    replication.release_all()
    """
)


def test_a_stopped_buddy_costs_a_save_a_bounded_time():
    reserved = topology.reserve_port("127.0.0.1")
    buddy = ("127.0.0.1", reserved.getsockname()[1])
    process = subprocess.Popen(
        [sys.executable, "-c", STOPPABLE, *map(str, buddy), SECRET], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env=child_env(), cwd="/",  # not the checkout
    )  # fmt: skip
    try:  # closed below, as `with Popen` would
        assert process.stdout.readline().strip() == "listening"
        with held_checkpoint(np.arange(2 << 20, dtype=np.float32)) as record:  # 8 MiB
            assert Replication(config(buddy, stall=4.0), record).wait() is None
            os.kill(process.pid, signal.SIGSTOP)
            started = time.monotonic()
            failed = Replication(config(buddy, stall=4.0), record).wait()
            took = time.monotonic() - started
        assert failed is not None
        assert took < 3.5, took  # half the stall timeout, and a margin
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        process.stdin.close()
        try:
            process.wait(TIMEOUT)
        finally:
            process.kill()
            process.stdout.close()
            reserved.close()


def test_retries_pause_longer_after_each_failure_and_reset_on_success():
    retries = replication._Retries()
    buddy = ("10.0.0.1", 1)
    assert retries.not_yet(buddy) is None
    retries.failed(buddy, "refused")
    assert "tried again in 10 s" in retries.not_yet(buddy)
    retries.failed(buddy, "refused")
    assert "failed 2 time(s) in a row (last: refused); tried again in 20 s" in retries.not_yet(
        buddy
    )
    for _ in range(6):
        retries.failed(buddy, "refused")
    assert "tried again in 120 s" in retries.not_yet(buddy)
    retries.succeeded(buddy)
    assert retries.not_yet(buddy) is None
    retries.FIRST = 0.05
    retries.failed(buddy, "refused")
    time.sleep(0.1)
    assert retries.not_yet(buddy) is None


def open_segments() -> set[str]:
    """Names of the /dev/shm files this process has open."""
    found = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = str(fd.readlink())
            if target.startswith(str(SHM_DIR) + "/"):
                found.add(target.rsplit("/", 1)[1].removesuffix(" (deleted)"))
    return found


def test_the_server_keeps_each_replica_open_until_it_is_freed():
    with replica_server() as server:
        with held_checkpoint(VALUES, "s1", 1) as record:
            assert send(server, record) is None
        path, held = replicas.replicas_of("/r", 2)[0]
        name = held["segment"]["name"]
        assert name in open_segments()  # an open segment is a live one
        records.release(path, held)  # freed elsewhere (a newer copy, the end of a hold, gc)
        wait_until(lambda: name not in open_segments(), 10, "the server to close it")
