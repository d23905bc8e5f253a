"""The wire between nodes and the buddy assignment, in one process over loopback: both ends of a
connection must know the job's secret (a peer without it gets nothing but the server's nonce),
a replica travels with sendfile and recv_into and is checked entry by entry where it lands, and
each rank's buddy is the same local rank on the next node."""

from __future__ import annotations

import socket
import threading
from typing import Any

import numpy as np
import pytest

from pyshmckpt import CheckpointCorruptError, ReplicationError
from pyshmckpt.tiers import records, replicas, wire
from pyshmckpt.tiers.records import HoldInfo
from pyshmckpt.tiers.topology import Peer, buddy, nodes

from helpers import SHM

TIMEOUT = 30


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    sock.settimeout(TIMEOUT)
    return sock


def serve_once(server: socket.socket, secret: str, then: Any = None) -> dict[str, Any]:
    """Accept one connection on a thread; what happened, once joined."""
    seen: dict[str, Any] = {}

    def run() -> None:
        conn, _ = server.accept()
        with conn:
            seen["authenticated"] = wire.accept(conn, secret, TIMEOUT)
            if seen["authenticated"] and then is not None:
                then(conn, seen)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    seen["thread"] = thread
    return seen


def test_both_sides_must_know_the_secret():
    secret = wire.new_secret()
    with listener() as server:
        seen = serve_once(server, secret, lambda conn, s: s.update(got=wire.recv_message(conn)))
        with wire.connect(server.getsockname(), secret, wire.Deadline(TIMEOUT)) as sock:
            wire.send_message(sock, {"hello": 1})
        seen["thread"].join(TIMEOUT)
    assert seen["authenticated"]
    assert seen["got"] == {"hello": 1}


def test_a_peer_without_the_secret_gets_nothing():
    secret = wire.new_secret()
    with listener() as server:
        seen = serve_once(server, secret, lambda conn, s: wire.send_message(conn, {"x": 1}))
        with pytest.raises(ReplicationError, match="authenticate|closed|answer"):
            wire.connect(server.getsockname(), wire.new_secret(), wire.Deadline(10))
        seen["thread"].join(TIMEOUT)
    assert seen["authenticated"] is False

    # A raw client that sends anything at all receives the magic and a nonce, then EOF.
    with listener() as server:
        seen = serve_once(server, secret, lambda conn, s: wire.send_message(conn, {"x": 1}))
        with socket.create_connection(server.getsockname(), timeout=TIMEOUT) as raw:
            raw.sendall(b"\0" * 48)
            received = b""
            while chunk := raw.recv(4096):
                received += chunk
        seen["thread"].join(TIMEOUT)
    assert seen["authenticated"] is False
    assert received.startswith(wire.MAGIC)
    assert len(received) == len(wire.MAGIC) + 16


def test_a_server_that_does_not_know_the_secret_is_refused():
    with listener() as server:
        seen = serve_once(server, wire.new_secret())
        with pytest.raises(ReplicationError):
            wire.connect(server.getsockname(), wire.new_secret(), wire.Deadline(10))
        seen["thread"].join(TIMEOUT)


def test_an_unreachable_peer_fails_within_the_deadline():
    with listener() as taken:
        address = taken.getsockname()
    with pytest.raises(ReplicationError, match="cannot reach"):
        wire.connect(address, wire.new_secret(), wire.Deadline(1.0))


def held_checkpoint(values: np.ndarray) -> tuple[dict[str, Any], Any, Any, Any]:
    """A checkpoint staged into a segment of ours, described as its writer would hold it."""
    import torch

    from pyshmckpt.shm import AttachedSegments
    from pyshmckpt.staging import SlotStager

    stager = SlotStager(slots=1)
    staged = stager.stage({"w": torch.from_numpy(values), "step": 3})
    handle = stager.handle(staged)
    attached = AttachedSegments()
    attached.sync(handle.segments())
    mapping = attached.slot(handle.address, handle.manifest.size)
    info = HoldInfo("/r", 2, 4, "s3", 7, False, 60.0, None, False)
    address = handle.address
    segment = (address.name, address.size, address.token)
    record = records.describe(handle.manifest, mapping, info, segment)
    return record, stager, staged, attached


@pytest.mark.parametrize("flip", [False, True])
def test_a_replica_lands_in_a_segment_checked_entry_by_entry(flip):
    pytest.importorskip("torch")
    values = np.arange(1 << 16, dtype=np.float32)
    record, stager, staged, attached = held_checkpoint(values)
    secret = wire.new_secret()
    try:
        name = record["segment"]["name"]
        if flip:  # the sender's bytes differ from what its record says
            with (SHM / name).open("r+b") as f:
                f.seek(int(record["segment"]["offset"]) + 100)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x10]))

        def receive(conn: socket.socket, seen: dict[str, Any]) -> None:
            try:
                seen["received"] = replicas.receive(conn, wire.Deadline(TIMEOUT))
            except CheckpointCorruptError as exc:
                seen["error"] = exc

        with listener() as server:
            seen = serve_once(server, secret, receive)
            deadline = wire.Deadline(TIMEOUT)
            with wire.connect(server.getsockname(), secret, deadline) as sock:
                replicas.send(sock, record, deadline)
            seen["thread"].join(TIMEOUT)
    finally:
        attached.sync([])
        del staged
        stager.close()
    if flip:
        assert "checksum mismatch" in str(seen.get("error")), seen
        assert seen["error"].tensor == "w"  # and its segment is gone (the leak check)
        return
    got, segment = seen["received"]
    try:
        assert got["name"] == "s3"
        assert got["rank"] == 2
        start = segment.data_offset
        landed = np.frombuffer(memoryview(segment)[start : start + values.nbytes], dtype=np.float32)
        assert np.array_equal(landed, values)
    finally:
        segment.unlink()
        segment.close()


def test_buddies_are_the_same_local_rank_on_the_next_node():
    peers = [Peer(r, f"10.0.0.{1 + r // 2}", 1000 + r) for r in range(6)]
    assert [[p.rank for p in n] for n in nodes(peers)] == [[0, 1], [2, 3], [4, 5]]
    assert [buddy(r, peers).rank for r in range(6)] == [2, 3, 4, 5, 0, 1]
    uneven = [Peer(0, "a", 1), Peer(1, "a", 2), Peer(2, "a", 3), Peer(3, "b", 4)]
    assert [buddy(r, uneven).rank for r in range(4)] == [3, 3, 3, 0]
    assert buddy(0, [Peer(0, "a", 1), Peer(1, "a", 2)]) is None


def test_replicate_needs_hold_and_several_ranks(tmp_path):
    from pyshmckpt import Checkpointer, ConfigError

    with pytest.raises(ConfigError, match="needs hold"):
        Checkpointer(tmp_path, slots=1, replicate=True)
    with pytest.raises(ConfigError, match="torch.distributed"):
        Checkpointer(tmp_path, replicate=True)
