"""Replicas over the wire, over loopback: a replica lands in a segment checked entry by entry; a
record from an authenticated peer that is malformed, of the wrong rank or checkpoint, or that
announces more bytes than its entries hold is refused with a typed error before anything is
allocated; a peer makes us allocate only what it actually sends; nothing is left behind."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import time

import numpy as np
import pytest
from peers import TIMEOUT, Server, held_checkpoint, receive

from pyshmckpt import CheckpointCorruptError, ReplicationError
from pyshmckpt.shm.stale import SHM_DIR
from pyshmckpt.tiers import replicas, wire

from helpers import SHM

pytestmark = pytest.mark.timeout(120)

LOCAL = ("segment", "holder", "agent", "deadline")


@pytest.mark.parametrize("flip", [False, True])
def test_a_replica_lands_in_a_segment_checked_entry_by_entry(flip):
    values = np.arange(1 << 16, dtype=np.float32)
    secret = wire.new_secret()
    with held_checkpoint(values) as record, Server(receive, secret) as server:
        if flip:  # the sender's bytes differ from what its record says
            with (SHM / record["segment"]["name"]).open("r+b") as f:
                f.seek(int(record["segment"]["offset"]) + 100)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x10]))
        deadline = wire.Deadline(TIMEOUT)
        with server.connect(secret) as channel:
            replicas.send(channel, record, deadline)
            with contextlib.suppress(ReplicationError):
                channel.recv_message(deadline)
        outcome = server.result()
    if flip:
        assert isinstance(outcome, CheckpointCorruptError), outcome
        assert "checksum mismatch" in str(outcome)
        assert outcome.tensor == "w"  # and its segment is gone (the leak check)
        return
    got, landed = outcome
    assert got["name"] == "s3"
    assert got["rank"] == 2
    assert np.array_equal(np.frombuffer(landed[: values.nbytes], dtype=np.float32), values)


def crafted(record, **changes):
    """The record as sent, with `changes` (None: the field removed)."""
    sent = {k: v for k, v in record.items() if k not in LOCAL}
    for field, value in changes.items():
        if value is None:
            sent.pop(field, None)
        else:
            sent[field] = value
    return sent


def huge_header(record, nbytes=1 << 50):
    """A header whose one tensor holds `nbytes` bytes."""
    raw = base64.b64decode(record["header"])
    (length,) = np.frombuffer(raw[:8], dtype="<u8")
    header = json.loads(raw[8 : 8 + int(length)])
    header = {k: v for k, v in header.items() if k == "__metadata__" or k == "w"}
    header["w"] = {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}
    body = json.dumps(header).encode()
    return base64.b64encode(len(body).to_bytes(8, "little") + body).decode()


CASES = {
    "no root": ({"root": None}, "no root"),
    "rank as text": ({"rank": "2"}, "rank is '2'"),
    "rank as a float": ({"rank": 2.5}, "rank is 2.5"),
    "rank as a boolean": ({"rank": True}, "rank is True"),
    "negative rank": ({"rank": -1}, "rank is -1"),
    "rank past the world": ({"rank": 9}, "rank 9 of a world of 4"),
    "huge data_bytes": ({"data_bytes": 1 << 50}, "tensors end at"),
    "data_bytes as text": ({"data_bytes": "5"}, "data_bytes is '5'"),
    "no header": ({"header": None}, "no header"),
    "a header that is not one": ({"header": "bm90IGEgaGVhZGVy"}, "malformed"),
    "described not an object": ({"described": [1]}, "no described"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_record_is_refused_before_anything_is_allocated(case):
    changes, reason = CASES[case]
    secret = wire.new_secret()
    with held_checkpoint(np.arange(1 << 12, dtype=np.float32)) as record:
        segments_before = ours()
        with Server(receive, secret) as server, server.connect(secret) as channel:
            sent = crafted(record, **changes)
            channel.send_message({"kind": "replica", "record": sent}, wire.Deadline(TIMEOUT))
            outcome = server.result()
        assert ours() == segments_before  # nothing was allocated for it
    assert type(outcome) is ReplicationError, outcome
    assert reason in str(outcome)


def test_a_copy_of_another_rank_or_checkpoint_than_asked_is_refused():
    secret = wire.new_secret()
    with held_checkpoint(np.arange(1 << 12, dtype=np.float32)) as record:
        for asked, reason in (({"rank": 1}, "not rank 1's"), ({"name": "s9"}, "not 's9'")):
            with Server(lambda c, a=asked: receive(c, **a), secret) as server:
                with server.connect(secret) as channel:
                    with contextlib.suppress(ReplicationError):
                        replicas.send(channel, record, wire.Deadline(TIMEOUT))
                outcome = server.result()
            assert type(outcome) is ReplicationError, outcome
            assert reason in str(outcome)


@pytest.mark.parametrize("nbytes", [1 << 50, 1 << 63, (1 << 64) + 4096])
def test_a_copy_larger_than_this_node_can_hold_is_refused(nbytes):
    """Larger than /dev/shm, than a segment may be, than a size fits in 64 bits: refused with a
    typed error, nothing allocated."""
    secret = wire.new_secret()
    with held_checkpoint(np.arange(1 << 12, dtype=np.float32)) as record:
        sent = crafted(record, header=huge_header(record, nbytes), data_bytes=nbytes)
        sent["described"] = dict(sent["described"], entries={"w": {"crc32c": 0}})
        with Server(receive, secret) as server, server.connect(secret) as channel:
            channel.send_message({"kind": "replica", "record": sent}, wire.Deadline(TIMEOUT))
            outcome = server.result()
    assert type(outcome) is ReplicationError, outcome
    assert "no room here" in str(outcome)


def test_a_peer_makes_us_allocate_only_what_it_sends():
    """A record of 32 MiB whose sender sends 1 MiB and stops: the copy holds about what arrived
    (pages are allocated piece by piece), and is gone once the sender gives up."""
    secret = wire.new_secret()
    values = np.arange(8 << 20, dtype=np.float32)  # 32 MiB
    with held_checkpoint(values) as record:
        mine = set(ours())
        with Server(receive, secret) as server, server.connect(secret) as channel:
            sent = crafted(record)
            channel.send_message({"kind": "replica", "record": sent}, wire.Deadline(TIMEOUT))
            channel.sock.sendall(b"\0" * (1 << 20))  # raw bytes: a tag would never come
            time.sleep(1.0)
            arrived = [n for n in ours() if n not in mine]
            allocated = sum((SHM_DIR / n).stat().st_blocks * 512 for n in arrived)
        outcome = server.result()
    assert len(arrived) == 1, arrived
    assert allocated <= (1 << 20) + wire.CHUNK + (1 << 16), allocated
    assert type(outcome) is ReplicationError, outcome


def ours() -> list[str]:
    prefix = os.environ["PYSHMCKPT_SEGMENT_PREFIX"] + "-"
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))
