"""pyshmckpt/transport/keeper.py: slot segments handed to the writer by descriptor over the
control channel, in step with the messages around them, and what happens when they cannot be."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from pyshmckpt import ProtocolError
from pyshmckpt.shm.native import Segment
from pyshmckpt.transport import keeper
from pyshmckpt.transport.channel import Kind, Request, send


@pytest.fixture
def channel():
    """Both ends of a control channel, as the writer's is (a socket pair)."""
    trainer, writer = multiprocessing.Pipe(duplex=True)
    yield trainer, writer
    trainer.close()
    writer.close()


def test_descriptors_arrive_between_the_messages_around_them(channel):
    trainer, writer = channel
    segments = [Segment.create(4096, os.environ["PYSHMCKPT_SEGMENT_PREFIX"]) for _ in range(2)]
    kept = keeper.Kept()
    try:
        assert keeper.hand_over(trainer, {s.name: s.fd for s in segments})
        assert send(trainer, Request(Kind.WRITE, 7))
        request = writer.recv()
        assert request.kind is Kind.KEEP
        kept.receive(writer, request)
        assert writer.recv().id == 7  # the next message reads as it was sent
        held = dict(kept._fds)
        assert sorted(held) == sorted(s.name for s in segments)
        for segment in segments:  # the very files: what keeps them in use
            assert os.fstat(held[segment.name]).st_ino == os.fstat(segment.fd).st_ino
        kept.retain([segments[0].name])
        assert list(kept._fds) == [segments[0].name]
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(held[segments[1].name])  # closed
    finally:
        kept.close()
        for segment in segments:
            segment.close()


def test_descriptors_that_cannot_follow_their_request_stop_the_channel(channel, monkeypatch):
    trainer, writer = channel
    nothing = 1 << 20  # a descriptor number that names nothing (past any descriptor limit)
    with pytest.raises(ProtocolError, match="could not follow"):
        keeper.hand_over(trainer, {"gone": nothing})
    request = writer.recv()  # the request went out before its descriptors failed
    assert request.kind is Kind.KEEP
    monkeypatch.setattr(keeper, "_FOLLOW", 0.2)  # a short wait for what never comes
    with pytest.raises(ProtocolError, match="did not follow"):
        keeper.Kept().receive(writer, request)


def test_a_writer_gone_takes_nothing(channel):
    trainer, writer = channel
    writer.close()
    segment = Segment.create(4096, os.environ["PYSHMCKPT_SEGMENT_PREFIX"])
    try:
        assert keeper.hand_over(trainer, {segment.name: segment.fd}) is False
    finally:
        segment.close()
