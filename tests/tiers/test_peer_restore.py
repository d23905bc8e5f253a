"""Serving and fetching another node's copy during a restore, over loopback: fetches are served
at once (one that hangs keeps no other waiting); a fetch gets the rank and checkpoint it asked
for or a typed error (a server that no longer holds it, or sends another rank's or another
checkpoint's copy, or stops sending), with nothing left behind."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from peers import TIMEOUT, held_checkpoint

from pyshmckpt import ReplicationError
from pyshmckpt.tiers import peer_restore, records, replicas, wire

pytestmark = pytest.mark.timeout(120)

VALUES = np.arange(1 << 14, dtype=np.float32)


@contextlib.contextmanager
def held_here(record: dict) -> Iterator[None]:
    """`record` (rank 2 of root "/r") published as a replica this node holds."""
    path = records.publish(
        dict(record, replica=True), 0, None, None, replicas.replica_path("/r", 2)
    )
    try:
        yield
    finally:
        records.withdraw(path)  # the segment is the stager's


@contextlib.contextmanager
def serving(wanted: dict[int, str], secret: str) -> Iterator[peer_restore.Server]:
    server = peer_restore.Server("/r", "127.0.0.1")
    try:
        server.serve(wanted, secret, TIMEOUT)
        yield server
    finally:
        server.close()


def fetched(address, secret, rank=2, **options):
    record, segment = peer_restore.fetch(address, secret, rank, TIMEOUT, **options)
    try:
        start = segment.data_offset
        return record, bytes(memoryview(segment)[start : start + int(record["data_bytes"])])
    finally:
        segment.unlink()
        segment.close()


def test_fetches_are_served_at_once():
    secret = wire.new_secret()
    with held_checkpoint(VALUES) as record, held_here(record), serving({2: "s3"}, secret) as server:
        me = wire.identity("restore", address=server.address)
        with wire.connect(
            server.address, secret, wire.Deadline(TIMEOUT), client="stuck", server=me
        ):  # authenticated, then silent
            started = time.monotonic()
            got, landed = fetched(server.address, secret, name="s3")
            assert time.monotonic() - started < 10
    assert got["name"] == "s3"
    assert np.array_equal(np.frombuffer(landed[: VALUES.nbytes], dtype=np.float32), VALUES)


def test_a_copy_the_server_does_not_hold_is_a_typed_error():
    secret = wire.new_secret()
    with held_checkpoint(VALUES) as record, held_here(record), serving({2: "s3"}, secret) as server:
        with pytest.raises(ReplicationError, match="does not hold"):
            fetched(server.address, secret, name="s4")  # asked for another checkpoint
        with pytest.raises(ReplicationError, match="does not hold"):
            fetched(server.address, secret, name="s3")  # each copy is served once


@contextlib.contextmanager
def restore_server(handle, secret: str) -> Iterator[tuple[str, int]]:
    """A member of the job serving fetches with `handle`; its address."""
    sock = socket.create_server(("127.0.0.1", 0))
    address = sock.getsockname()[:2]
    me = wire.identity("restore", address=address)
    listener = wire.Listener(sock, secret, me, handle, name="test-restore")
    try:
        yield address
    finally:
        listener.close(TIMEOUT)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [({"rank": 3}, "not rank 2's"), ({"name": "s9"}, "not 's3'")],
)
def test_a_copy_of_another_rank_or_checkpoint_than_asked_is_refused(changes, reason):
    secret = wire.new_secret()
    with held_checkpoint(VALUES) as record:

        def lie(channel: wire.Channel) -> None:
            channel.recv_message(wire.Deadline(TIMEOUT))
            replicas.send(channel, dict(record, **changes), wire.Deadline(TIMEOUT))

        with restore_server(lie, secret) as address:
            with pytest.raises(ReplicationError, match=reason):
                fetched(address, secret, name="s3")


def test_a_server_that_stops_sending_fails_the_fetch_within_its_idle_limit():
    secret = wire.new_secret()
    released = threading.Event()

    def stall(channel: wire.Channel) -> None:
        channel.recv_message(wire.Deadline(TIMEOUT))
        released.wait(TIMEOUT)

    with restore_server(stall, secret) as address:
        started = time.monotonic()
        try:
            with pytest.raises(ReplicationError, match="nothing moved"):
                fetched(address, secret, name="s3", idle=1.0)
        finally:
            released.set()
        assert time.monotonic() - started < 3
