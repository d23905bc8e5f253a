"""The wire between nodes, over loopback with real sockets: both ends must know the job's secret
(a peer without it gets nothing but the server's greeting); every message and every piece of a
checkpoint's bytes after the handshake is authenticated under the connection's own keys, in
every suite, so a man in the middle who changes a record or a byte (keeping the CRC32C true),
or relays a connection or a message to another member of the job, is caught; a listener
outlives floods of connections that never authenticate and errors of accept(); encryption is a
setting that needs the `cryptography` package."""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from peers import (
    TIMEOUT,
    Proxy,
    Server,
    data_of,
    echo,
    entry_range,
    flip_keeping_crc,
    held_checkpoint,
    receive,
    reframed,
)

from pyshmckpt import ConfigError, ReplicationError
from pyshmckpt.shm.native import crc32c
from pyshmckpt.tiers import replicas, wire
from pyshmckpt.tiers.replication import ReplicaConfig
from pyshmckpt.tiers.topology import Peer, buddy, nodes

from helpers import child_env

pytestmark = pytest.mark.timeout(120)

# The suites of the cryptography package (in the test extra) are skipped without it.
_crypto = pytest.mark.skipif(wire._aesgcm() is None, reason="needs the cryptography package")
MACS = [wire.HMAC_SHA256, pytest.param(wire.AES_GMAC, marks=_crypto)]
ALL = [*MACS, pytest.param(wire.AES_GCM, marks=_crypto)]
OVERHEAD = {wire.HMAC_SHA256: 32, wire.AES_GMAC: 16, wire.AES_GCM: 16}


def test_both_sides_must_know_the_secret():
    secret = wire.new_secret()
    with Server(echo, secret) as server:
        with server.connect(secret) as channel:
            channel.send_message({"hello": 1}, wire.Deadline(TIMEOUT))
            answer = channel.recv_message(wire.Deadline(TIMEOUT))
        assert server.result() == {"hello": 1}
    assert answer == {"echo": {"hello": 1}}
    assert channel.suite == wire.suites()[0]  # with cryptography: AES-GMAC, the cheaper MAC


def test_a_peer_without_the_secret_gets_nothing():
    secret = wire.new_secret()
    with Server(echo, secret) as server:
        with pytest.raises(ReplicationError, match="authenticate|closed|broke|finish"):
            server.connect(wire.new_secret())

        # A raw client that sends anything at all receives the magic and a nonce, then EOF.
        with socket.create_connection(server.address, timeout=TIMEOUT) as raw:
            raw.sendall(b"\0" * 32 + b"\0\x02{}" + b"\0" * 32)
            received = b""
            while chunk := raw.recv(4096):
                received += chunk
    assert received.startswith(wire.MAGIC)
    assert len(received) == len(wire.MAGIC) + 32
    assert not server.results  # no session was started


def test_a_server_that_does_not_know_the_secret_is_refused():
    with Server(echo, wire.new_secret()) as server:
        with pytest.raises(ReplicationError, match="authenticate|closed|broke"):
            server.connect(wire.new_secret())


def test_an_unreachable_peer_fails_within_the_deadline():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = taken.getsockname()[:2]
    started = time.monotonic()
    with pytest.raises(ReplicationError, match="cannot reach"):
        wire.connect(address, wire.new_secret(), wire.Deadline(1.0), client="c", server="s")
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("suite", ALL)
def test_every_suite_carries_messages_and_bytes(suite, tmp_path):
    """Several pieces of bytes (and an uneven last one), from a file with sendfile (or through a
    buffer, encrypted) into a buffer, every piece authenticated."""
    data = np.random.default_rng(0).integers(0, 256, 2 * wire.CHUNK + 12345, dtype=np.uint8)
    source = tmp_path / "data"
    source.write_bytes(data.tobytes())
    secret = wire.new_secret()

    def take(channel: wire.Channel) -> bytes:
        message = channel.recv_message(wire.Deadline(TIMEOUT))
        landed = bytearray(message["size"])
        ends: list[int] = []
        channel.recv_into(memoryview(landed), wire.Deadline(TIMEOUT), landed=ends.append)
        channel.send_message({"ends": ends}, wire.Deadline(TIMEOUT))
        return bytes(landed)

    with Server(take, secret) as server:
        with server.connect(secret, offer=[suite]) as channel, source.open("rb") as f:
            assert channel.suite == suite
            channel.send_message({"size": data.size}, wire.Deadline(TIMEOUT))
            moved: list[int] = []
            channel.send_file(f.fileno(), 0, data.size, wire.Deadline(TIMEOUT), moved.append)
            ends = channel.recv_message(wire.Deadline(TIMEOUT))["ends"]
        assert server.result() == data.tobytes()
    assert sum(moved) == data.size
    assert ends == [wire.CHUNK, 2 * wire.CHUNK, data.size]


# -- a man in the middle ---------------------------------------------------------------------------


def through_proxy(suite, record, **tamper):
    """Send `record`'s checkpoint through a man in the middle to a receiving server; what the
    server's session ended with, and the proxy."""
    secret = wire.new_secret()
    with Server(receive, secret) as server:
        proxy = Proxy(server.address, OVERHEAD[suite], **tamper)
        try:
            deadline = wire.Deadline(TIMEOUT)
            with wire.connect(
                proxy.address, secret, deadline, client="test-client", server=server.me,
                offer=[suite],
            ) as channel:  # fmt: skip
                try:
                    replicas.send(channel, record, deadline)
                    channel.recv_message(deadline)
                except ReplicationError:
                    pass  # the server broke off: what it found is in its result
            return server.result(), proxy
        finally:
            proxy.close()


@pytest.mark.parametrize("suite", ALL)
def test_an_untouched_relay_delivers(suite):
    values = np.arange(1 << 16, dtype=np.float32)
    with held_checkpoint(values) as record:
        outcome, proxy = through_proxy(suite, record)
    got, landed = outcome
    assert got["name"] == "s3"
    assert np.array_equal(np.frombuffer(landed[: values.nbytes], dtype=np.float32), values)
    pattern = values[1000:1100].tobytes()
    assert (pattern in proxy.streamed) is (suite != wire.AES_GCM)  # encrypted: not in clear


@pytest.mark.parametrize("suite", MACS)
def test_a_changed_record_is_rejected(suite):
    """The man in the middle flips a byte of the data and puts that data's CRC32C into the
    record: the CRC32C check would pass; the record's MAC does not."""
    values = np.arange(1 << 16, dtype=np.float32)
    with held_checkpoint(values) as record:
        start, length = entry_range(record, "w")
        data = bytearray(data_of(record))
        data[start + 100] ^= 0x10
        forged = crc32c(bytes(data[start : start + length]))

        def flip(payload: bytearray) -> None:
            payload[start + 100] ^= 0x10

        def new_crc(body: dict) -> None:
            body["record"]["described"]["entries"]["w"]["crc32c"] = forged

        outcome, _ = through_proxy(
            suite, record, tamper_frame=lambda f: reframed(f, new_crc), tamper_data=flip
        )
    assert isinstance(outcome, ReplicationError), outcome
    assert "failed authentication" in str(outcome)  # and its segment is gone (the leak check)


@pytest.mark.parametrize("suite", ALL)
def test_a_changed_byte_is_rejected_though_its_crc_holds(suite):
    values = np.arange(1 << 16, dtype=np.float32)
    with held_checkpoint(values) as record:
        start, length = entry_range(record, "w")
        original = crc32c(data_of(record)[start : start + length])

        def flip(payload: bytearray) -> None:
            flip_keeping_crc(payload, start + 100, start + 2000, start + length, start)
            assert crc32c(bytes(payload[start : start + length])) == original

        if suite == wire.AES_GCM:  # encrypted: the man in the middle flips a byte blindly

            def flip(payload: bytearray) -> None:
                payload[start + 100] ^= 0x10

        outcome, _ = through_proxy(
            suite, record, tamper_data=flip, data_bytes=int(record["data_bytes"])
        )
    assert isinstance(outcome, ReplicationError), outcome
    assert "failed authentication" in str(outcome)


def test_a_connection_relayed_to_another_member_is_refused():
    """A client that means to reach member B, relayed to member C (same secret): C refuses."""
    secret = wire.new_secret()
    with Server(echo, secret) as b, Server(echo, secret) as c:
        proxy = Proxy(c.address, OVERHEAD[wire.suites()[0]])
        try:
            with pytest.raises(ReplicationError, match="refused the connection: this is"):
                wire.connect(proxy.address, secret, wire.Deadline(TIMEOUT), client="a", server=b.me)
        finally:
            proxy.close()
        assert not b.results
        assert not c.results


def test_a_message_replayed_into_another_connection_is_rejected():
    secret = wire.new_secret()
    with Server(echo, secret) as server:
        first = Proxy(server.address, OVERHEAD[wire.suites()[0]])
        try:
            with wire.connect(
                first.address, secret, wire.Deadline(TIMEOUT), client="a", server=server.me
            ) as channel:
                channel.send_message({"delete": "nothing"}, wire.Deadline(TIMEOUT))
                channel.recv_message(wire.Deadline(TIMEOUT))
            assert server.result() == {"delete": "nothing"}
        finally:
            first.close()
        captured = first.frames[0]
        second = Proxy(
            server.address, OVERHEAD[wire.suites()[0]], tamper_frame=lambda frame: captured
        )
        try:
            with wire.connect(
                second.address, secret, wire.Deadline(TIMEOUT), client="a", server=server.me
            ) as channel:
                channel.send_message({"delete": "everything"}, wire.Deadline(TIMEOUT))
                with pytest.raises(ReplicationError):
                    channel.recv_message(wire.Deadline(TIMEOUT))
        finally:
            second.close()
        outcome = server.result()
    assert isinstance(outcome, ReplicationError)
    assert "failed authentication" in str(outcome)


# -- bounds ----------------------------------------------------------------------------------------


def test_a_message_too_deep_or_too_large_is_refused():
    secret = wire.new_secret()

    def take(channel: wire.Channel) -> None:
        channel.recv_message(wire.Deadline(TIMEOUT), limit=1 << 20)

    with Server(take, secret) as server:
        for body in (b"[" * 100_000 + b"]" * 100_000, b"[" * 300 + b"]" * 300):
            with server.connect(secret) as channel:
                channel._send_body(b'{"x":' + body + b"}", wire.Deadline(TIMEOUT))
                outcome = server.result()
            assert isinstance(outcome, ReplicationError), outcome
            assert "malformed" in str(outcome)
        with server.connect(secret) as channel:
            with contextlib.suppress(ReplicationError):  # refused from its length on: reset
                channel.send_message({"x": "y" * (2 << 20)}, wire.Deadline(TIMEOUT))
            outcome = server.result()
        assert isinstance(outcome, ReplicationError)
        assert "too large" in str(outcome)


def test_a_silent_or_trickling_peer_is_bounded_overall_not_per_read():
    secret = wire.new_secret()

    def take(channel: wire.Channel) -> None:
        channel.recv_message(wire.Deadline(2.0, idle=1.0))

    with Server(take, secret) as server:
        with server.connect(secret) as channel:  # silent: nothing moves for 1 s
            started = time.monotonic()
            outcome = server.result()
            assert isinstance(outcome, ReplicationError)
            assert "nothing moved" in str(outcome)
            assert time.monotonic() - started < 1.9
        with server.connect(secret) as channel:  # a byte every 0.3 s: the 2 s overall bound
            started = time.monotonic()
            for _ in range(10):
                time.sleep(0.3)
                try:
                    channel.sock.send(b"\0")
                except OSError:
                    break
            outcome = server.result()
            assert isinstance(outcome, ReplicationError)
            assert "within 2 s" in str(outcome)
            assert time.monotonic() - started < 3.5


def test_idle_and_trickling_connections_do_not_stop_an_authenticated_one():
    """Hundreds of connections that never authenticate (silent ones, and ones trickling a byte
    at a time): each is dropped by the handshake deadline or for a newer one, and a member's
    connection in the middle of them is served."""
    secret = wire.new_secret()
    flood: list[socket.socket] = []
    with Server(echo, secret, pending=32, handshake_timeout=2.0) as server:
        stop = threading.Event()

        def trickle(sock: socket.socket) -> None:
            while not stop.wait(0.3):
                try:
                    sock.send(b"\1")
                except OSError:
                    return

        try:
            for i in range(300):
                sock = socket.create_connection(server.address, timeout=TIMEOUT)
                flood.append(sock)
                if i % 6 == 0:
                    threading.Thread(target=trickle, args=(sock,), daemon=True).start()
            started = time.monotonic()
            with server.connect(secret) as channel:
                channel.send_message({"member": True}, wire.Deadline(TIMEOUT))
                assert channel.recv_message(wire.Deadline(TIMEOUT)) == {"echo": {"member": True}}
            assert time.monotonic() - started < 10
            time.sleep(3.0)  # past the handshake deadline: every flooding connection is dropped
            closed = sum(1 for sock in flood if _closed_by_peer(sock))
        finally:
            stop.set()
            for sock in flood:
                sock.close()
    assert closed == len(flood)


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(1.0)
    try:
        while chunk := sock.recv(4096):
            if not chunk.startswith(wire.MAGIC) and len(chunk) > len(wire.MAGIC) + 32:
                return False
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_sessions_are_served_at_once():
    """A member's connection that hangs in its session does not keep another from being served."""
    secret = wire.new_secret()
    with Server(echo, secret) as server:
        with server.connect(secret) as stuck, server.connect(secret) as channel:
            channel.send_message({"second": 1}, wire.Deadline(TIMEOUT))
            assert channel.recv_message(wire.Deadline(5)) == {"echo": {"second": 1}}
            stuck.send_message({"first": 1}, wire.Deadline(TIMEOUT))
            assert stuck.recv_message(wire.Deadline(5)) == {"echo": {"first": 1}}


LISTENER = textwrap.dedent(
    """
    import logging, os, resource, socket, sys, threading
    from pyshmckpt.tiers import wire

    logging.basicConfig(level=logging.WARNING)

    secret = sys.argv[1]

    def echo(channel):
        channel.send_message(channel.recv_message(wire.Deadline(30)), wire.Deadline(30))

    sock = socket.create_server(("127.0.0.1", 0))
    listener = wire.Listener(sock, secret, "test-server", echo, name="t", handshake_timeout=5)
    print(sock.getsockname()[1], flush=True)
    sys.stdin.readline()

    # No descriptor left: accept() fails with EMFILE while clients wait in the kernel's queue.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
    spent = []
    while True:
        try:
            spent.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            break
    print("full", flush=True)
    sys.stdin.readline()
    for fd in spent:
        os.close(fd)
    print("freed", flush=True)
    sys.stdin.readline()

    # No thread to be had: an authenticated connection is closed, the port stays.
    status = open("/proc/self/status").read()
    size = int(next(l for l in status.splitlines() if l.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))
    threading.stack_size(1 << 30)
    print("no threads", flush=True)
    sys.stdin.readline()
    threading.stack_size(0)
    print("threads", flush=True)
    sys.stdin.readline()
    listener.close()
    print("closed", flush=True)
    """
)


def test_the_listener_outlives_accept_errors_and_failed_thread_starts(tmp_path):
    secret = wire.new_secret()
    process = subprocess.Popen(
        [sys.executable, "-c", LISTENER, secret], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=child_env(), cwd="/",  # not the checkout
    )  # fmt: skip
    try:

        def said() -> str:
            return process.stdout.readline().strip()

        def go_on() -> None:
            process.stdin.write("\n")
            process.stdin.flush()

        address = ("127.0.0.1", int(said()))

        def member(deadline: float = TIMEOUT) -> dict:
            with wire.connect(
                address, secret, wire.Deadline(deadline), client="c", server="test-server"
            ) as channel:
                channel.send_message({"n": 1}, wire.Deadline(deadline))
                return channel.recv_message(wire.Deadline(deadline))

        assert member() == {"n": 1}
        go_on()
        assert said() == "full"
        waiting = [socket.create_connection(address, timeout=TIMEOUT) for _ in range(3)]
        with pytest.raises(ReplicationError):
            member(2.0)  # no descriptor to accept it with: it waits, then gives up
        go_on()
        assert said() == "freed"
        assert member() == {"n": 1}
        for sock in waiting:
            sock.close()
        go_on()
        assert said() == "no threads"
        with pytest.raises(ReplicationError):
            member(5.0)
        go_on()
        assert said() == "threads"
        assert member() == {"n": 1}
        go_on()
        assert said() == "closed"
        assert process.wait(TIMEOUT) == 0
    finally:
        process.kill()
        _, err = process.communicate(timeout=TIMEOUT)
    assert "accept() failed" in err  # said once, in a warning
    assert "cannot start a thread" in err


def test_connections_churning_past_the_handshake_limit_never_stop_the_listener(caplog):
    """Connections that arrive while the handshakes are full push the oldest out, also one whose
    bytes are in the same batch of events: the listener goes on serving members."""
    secret = wire.new_secret()
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            opened = []
            for _ in range(8):
                with contextlib.suppress(OSError):
                    sock = socket.create_connection(server.address, timeout=TIMEOUT)
                    sock.send(b"x")  # readable at the listener at once, beside the next accept
                    opened.append(sock)
            for sock in opened:
                sock.close()

    with Server(echo, secret, pending=2) as server:
        threads = [threading.Thread(target=churn) for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(3.0)
        finally:
            stop.set()
            for thread in threads:
                thread.join(TIMEOUT)
        with server.connect(secret) as channel:
            channel.send_message({"after": "the churn"}, wire.Deadline(TIMEOUT))
            assert channel.recv_message(wire.Deadline(TIMEOUT)) == {"echo": {"after": "the churn"}}
        assert server.result() == {"after": "the churn"}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors


# -- settings --------------------------------------------------------------------------------------


@_crypto
def test_encryption_is_chosen_when_either_end_asks(monkeypatch):
    secret = wire.new_secret()
    with Server(echo, secret) as server:
        with server.connect(secret, encrypt=True) as channel:
            assert channel.suite == wire.AES_GCM
            channel.send_message({"x": 1}, wire.Deadline(TIMEOUT))
            assert channel.recv_message(wire.Deadline(TIMEOUT)) == {"echo": {"x": 1}}
    monkeypatch.setenv("PYSHMCKPT_REPLICA_ENCRYPT", "1")
    assert wire.suites() == (wire.AES_GCM,)
    with Server(echo, secret) as server:
        with server.connect(secret, encrypt=False) as channel:
            assert channel.suite == wire.AES_GCM
        with pytest.raises(ReplicationError, match="no suite in common"):
            server.connect(secret, offer=[wire.HMAC_SHA256])  # an end without cryptography
    monkeypatch.setenv("PYSHMCKPT_REPLICA_ENCRYPT", "maybe")
    with pytest.raises(ConfigError, match="PYSHMCKPT_REPLICA_ENCRYPT"):
        wire.suites()


def test_encryption_without_cryptography_names_the_extra():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["cryptography"] = None  # as if it were not installed
        from pyshmckpt import ConfigError
        from pyshmckpt.tiers import wire
        assert wire.suites(False) == (wire.HMAC_SHA256,)
        try:
            wire.suites(True)
        except ConfigError as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT,
        env=child_env(), cwd="/",  # not the checkout, whose source tree has no extension
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "python -m pip install 'cryptography>=42'" in done.stdout


def test_a_replica_config_does_not_show_its_secret():
    secret = wire.new_secret()
    config = ReplicaConfig(("a", 1), ("b", 2), 3, secret, 10.0, 60.0, None)
    assert secret not in repr(config)
    assert secret not in str(config)


def test_buddies_are_the_same_local_rank_on_the_next_node():
    peers = [Peer(r, f"10.0.0.{1 + r // 2}", 1000 + r) for r in range(6)]
    assert [[p.rank for p in n] for n in nodes(peers)] == [[0, 1], [2, 3], [4, 5]]
    assert [buddy(r, peers).rank for r in range(6)] == [2, 3, 4, 5, 0, 1]
    uneven = [Peer(0, "a", 1), Peer(1, "a", 2), Peer(2, "a", 3), Peer(3, "b", 4)]
    assert [buddy(r, uneven).rank for r in range(4)] == [3, 3, 3, 0]
    assert buddy(0, [Peer(0, "a", 1), Peer(1, "a", 2)]) is None


def test_replicate_needs_hold_and_several_ranks(tmp_path):
    from pyshmckpt import Checkpointer

    with pytest.raises(ConfigError, match="needs hold"):
        Checkpointer(tmp_path, slots=1, replicate=True)
    with pytest.raises(ConfigError, match="torch.distributed"):
        Checkpointer(tmp_path, replicate=True)
