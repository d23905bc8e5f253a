"""The simulated-node harness (tests/simnodes.py): each node has an address, a hostname and a
private /dev/shm shared by its processes; nodes talk TCP; a failed node loses every process and
its /dev/shm; nothing of a harness outlives it, nor a harness whose process was SIGKILLed."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from simnodes import Node, simulated_nodes, unavailable

from helpers import SHM, child_env, pid_running, wait_until

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 30  # seconds any process a test starts may take

SERVER = textwrap.dedent(
    """
    import hashlib, socket, sys

    with socket.create_server(("", int(sys.argv[1]))) as server:
        conn, peer = server.accept()
        data = bytearray()
        with conn:
            while chunk := conn.recv(1 << 16):
                data += chunk
    print(len(data), hashlib.sha256(data).hexdigest(), peer[0])
    """
)

CLIENT = textwrap.dedent(
    """
    import socket, sys, time

    host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:  # the server listens on every address of node 1, none of them node 0's loopback
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        sys.exit("node 0's loopback reached a server of node 1")
    except ConnectionRefusedError:
        pass
    deadline = time.monotonic() + 20
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except ConnectionRefusedError:  # not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    with conn:
        conn.sendall(bytes(range(256)) * (size // 256))
    """
)

RESOLVE = "import socket; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))"


@pytest.fixture
def available() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def nodes(available: None) -> Iterator[list[Node]]:
    with simulated_nodes(2, shm_size="16m") as nodes:
        yield nodes


def segment_name(what: str) -> str:
    """A name with this session's segment prefix: the leak check fails a test that makes it on
    the host's /dev/shm."""
    return f"{os.environ['PYSHMCKPT_SEGMENT_PREFIX']}-simnodes-{what}"


def test_each_node_has_its_address_hostname_and_a_private_shm_its_processes_share(nodes):
    assert [node.index for node in nodes] == [0, 1]
    assert nodes[0].address != nodes[1].address
    assert nodes[0].address.rsplit(".", 1)[0] == nodes[1].address.rsplit(".", 1)[0]
    for node in nodes:
        assert node.is_up
        assert node.shm_files() == []
        shown = node.run([sys.executable, "-c", RESOLVE], timeout=TIMEOUT, check=True)
        assert shown.stdout.split() == [node.hostname, node.address]
    peer = nodes[0].run(["getent", "hosts", nodes[1].hostname], timeout=TIMEOUT, check=True)
    assert peer.stdout.split() == [nodes[1].address, nodes[1].hostname]

    name = segment_name("private")
    waiter = nodes[0].start(
        ["sh", "-c", 'for i in $(seq 1000); do [ -e "/dev/shm/$1" ] && exit 0; sleep 0.02; done;'
         " exit 1", "waiter", name],
    )  # fmt: skip
    nodes[0].run(["sh", "-c", f"echo node0 > /dev/shm/{name}"], timeout=TIMEOUT, check=True)
    assert waiter.wait(timeout=TIMEOUT) == 0, "a running process of the node did not see the file"
    later = nodes[0].run(["cat", f"/dev/shm/{name}"], timeout=TIMEOUT, check=True)
    assert later.stdout == "node0\n", "the file did not outlive the process that made it"
    assert nodes[0].shm_files() == [name]
    assert (nodes[0].shm_dir / name).read_text() == "node0\n"
    assert nodes[1].shm_files() == []
    assert nodes[1].run(["ls", "-A", "/dev/shm"], timeout=TIMEOUT, check=True).stdout == ""
    assert not (SHM / name).exists()
    df = nodes[0].run(["df", "-k", "--output=size", "/dev/shm"], timeout=TIMEOUT, check=True)
    assert df.stdout.split()[-1] == str(16 * 1024), df.stdout


def test_a_node_reaches_another_by_its_address_over_tcp(nodes):
    port, size = 5000, 8 << 20  # ports are per node: any is free
    server = nodes[1].start(
        [sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    client = nodes[0].run(
        [sys.executable, "-c", CLIENT, nodes[1].address, str(port), str(size)], timeout=TIMEOUT
    )
    out, err = server.communicate(timeout=TIMEOUT)
    assert client.returncode == 0, client.stderr
    assert server.returncode == 0, err
    expected = hashlib.sha256(bytes(range(256)) * (size // 256)).hexdigest()
    assert out.split() == [str(size), expected, nodes[0].address]


def test_a_failed_node_loses_every_process_and_comes_back_with_an_empty_shm(nodes):
    lost, survivor = nodes
    address = lost.address
    lost.run(["touch", f"/dev/shm/{segment_name('lost')}"], timeout=TIMEOUT, check=True)
    sleeper = lost.start(["sleep", "600"])
    parent = lost.start(["sh", "-c", "sleep 600 & sleep 600 & wait"])
    other = survivor.start(["sleep", "600"])
    # The keeper, the sleeper, the shell and its two children.
    wait_until(lambda: len(lost.processes()) >= 5, TIMEOUT, "the lost node's processes to start")
    before = lost.processes()
    assert {sleeper.pid, parent.pid} <= set(before)
    assert other.pid in survivor.processes()
    assert other.pid not in before

    lost.fail()
    assert lost.processes() == []
    assert not any(pid_running(pid) for pid in before)
    assert sleeper.returncode == -signal.SIGKILL
    assert parent.returncode == -signal.SIGKILL
    assert not lost.is_up
    with pytest.raises(RuntimeError, match="down"):
        lost.shm_files()
    assert other.poll() is None, "the other node lost a process too"
    assert survivor.is_up

    lost.up()
    assert lost.shm_files() == []
    assert lost.address == address
    shown = lost.run([sys.executable, "-c", RESOLVE], timeout=TIMEOUT, check=True)
    assert shown.stdout.split() == [lost.hostname, address]
    lost.restart()  # restart() of a node that is up: fail, then up
    assert lost.is_up
    assert lost.shm_files() == []


class Crash(Exception):
    pass


def leftovers(tag: str) -> list[str]:
    """Network namespaces, links and hosts files whose names start with `tag`."""
    listed = subprocess.run(
        ["sh", "-c", "ip netns list; ip -o link show"], capture_output=True, text=True,
        timeout=TIMEOUT, check=True,
    ).stdout  # fmt: skip
    found = [word for word in listed.replace(":", " ").split() if word.startswith(tag)]
    return found + [str(p) for p in Path(tempfile.gettempdir()).glob(f"{tag}-*")]


def test_exit_removes_every_process_namespace_and_link_even_after_an_error(available):
    tags: list[str] = []
    pids: list[int] = []

    def crash_inside() -> None:
        with simulated_nodes(2, shm_size="16m") as nodes:
            tags.append(nodes[0].bridge.removesuffix("br"))
            for node in nodes:
                node.start(["sleep", "600"])
            wait_until(
                lambda: all(len(node.processes()) == 2 for node in nodes), TIMEOUT, "the sleepers"
            )
            pids.extend(pid for node in nodes for pid in node.processes())  # keepers, sleepers
            assert leftovers(tags[0])  # what must go
            raise Crash

    with pytest.raises(Crash):
        crash_inside()
    assert leftovers(tags[0]) == []
    assert not any(pid_running(pid) for pid in pids)


def test_a_harness_whose_process_was_killed_is_swept_by_the_next(available, tmp_path):
    ready = tmp_path / "ready"
    script = textwrap.dedent(
        f"""
        import pathlib, time
        from simnodes import simulated_nodes

        with simulated_nodes(1, shm_size="16m") as nodes:
            tag, (keeper,) = nodes[0].bridge.removesuffix("br"), nodes[0].processes()
            partial = pathlib.Path({str(ready)!r} + ".partial")
            partial.write_text(f"{{tag}} {{keeper}}")
            partial.rename({str(ready)!r})  # whole or absent: the test kills this process on sight
            time.sleep(600)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], env=child_env())
    try:
        wait_until(lambda: ready.exists() or owner.poll() is not None, TIMEOUT, "the harness")
        assert owner.poll() is None, f"the harness process exited with {owner.returncode}"
    finally:
        owner.kill()
        owner.wait(TIMEOUT)
    tag, keeper = ready.read_text().split()
    assert pid_running(int(keeper))
    assert leftovers(tag), "a killed harness left nothing behind: nothing to sweep"

    with simulated_nodes(1, shm_size="16m"):
        assert leftovers(tag) == []
        wait_until(lambda: not pid_running(int(keeper)), TIMEOUT, "the old keeper to die")
