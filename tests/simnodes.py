"""Simulated nodes on one machine, for multi-node tests and benchmarks (needs root).

A node is what a training job sees of a machine:

- a network namespace with an IPv4 address of its own (``eth0``, one end of a veth pair whose
  other end is attached to a bridge of the harness, so nodes reach each other by address),
- a UTS namespace with a hostname of its own; every node's ``/etc/hosts`` names every node, so
  torchrun, c10d and gloo resolve a node's hostname to its address as they would on a cluster,
- a mount namespace whose ``/dev/shm`` is a private tmpfs.

A keeper process (``sleep``) holds the namespaces while the node is up: every process started on
the node enters the keeper's namespaces (``nsenter``), so they all share one ``/dev/shm``, which
outlives them until the node fails.

A node fails as a lost machine does: :meth:`Node.fail` SIGKILLs every process in the node's
namespaces, the keeper included; no cleanup code runs, and the tmpfs on its ``/dev/shm`` goes with
the mount namespace. :meth:`Node.up` then brings a replaced machine: same address and hostname,
an empty ``/dev/shm``.

Usage (tests skip where namespaces cannot be made)::

    reason = simnodes.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with simnodes.simulated_nodes(2) as nodes:
        server = nodes[1].start([...], env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        client = nodes[0].run([...], timeout=60)

Names carry the pid of the process that made them (``psk<pid><letter>``: bridge ``...br``,
namespaces ``...n<i>``, host ends of the veths ``...v<i>``), so parallel pytest workers never
share one. The subnet is ``10.<128 + pid // 256 % 128>.<pid % 256>.0/24``, but the bridge has no
address on the host and each node has a route to its subnet only, so two harnesses cannot reach
each other even where their subnets are equal: the host cannot reach the nodes either (run
clients on a node). Leftovers of a process that died without tearing down (SIGKILL) are removed
when the next harness starts.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import itertools
import logging
import os
import re
import select
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

PREFIX = "psk"
MAX_NODES = 254  # host numbers .1 to .254 of the /24
COMMAND_TIMEOUT = 30.0  # seconds an `ip` command or the availability probe may take
UP_TIMEOUT = 30.0  # seconds a node's keeper may take to mount its /dev/shm
FAIL_TIMEOUT = 15.0  # seconds fail() may take until no process of the node is left
NETNS_DIR = Path("/run/netns")

# Links (bridge "br", host-side veth "v<i>") and namespaces ("n<i>") of a harness.
_LINK_NAME = re.compile(rf"^{PREFIX}(\d+)([a-z])(?:br|v\d+)$")
_NETNS_NAME = re.compile(rf"^{PREFIX}(\d+)([a-z])n\d+$")
_HOSTS_DIR_NAME = re.compile(rf"^{PREFIX}(\d+)([a-z])-")
_instances = itertools.count()  # harnesses made by this process: the letter of each tag


class SimulatedNodesUnavailable(RuntimeError):
    """Namespaces, veths or bridges cannot be made here (the message says why)."""


@functools.cache
def unavailable() -> str | None:
    """Why simulated nodes cannot run here (not root, a tool missing, namespaces not allowed), or
    None when they can. Tests skip with this reason; `simulated_nodes` raises it."""
    if not sys.platform.startswith("linux"):
        return "simulated nodes need Linux namespaces"
    if os.geteuid() != 0:
        return "simulated nodes need root (network, mount and UTS namespaces, veths, a bridge)"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"simulated nodes need `{tool}` (iproute2 / util-linux), not found on PATH"
    # Everything a node needs, in throwaway namespaces that vanish with the probe.
    probe = (
        "ip link set lo up && ip link add probebr type bridge && "
        "ip link add probev type veth peer name probep && ip link set probev master probebr && "
        "echo probe > /proc/sys/kernel/hostname && mount -t tmpfs -o size=1m tmpfs /dev/shm"
    )
    try:
        done = subprocess.run(
            ["unshare", "--net", "--mount", "--uts", "--propagation", "private", "sh", "-c", probe],
            capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make namespaces for simulated nodes: {exc}"
    if done.returncode != 0:
        return f"cannot make namespaces for simulated nodes: {done.stderr.strip()}"
    if not os.access(NETNS_DIR.parent, os.W_OK):
        return f"cannot name network namespaces: {NETNS_DIR.parent} is not writable"
    return None


def subnet_of(pid: int) -> ipaddress.IPv4Network:
    """The /24 of the harnesses of process `pid` (distinct for pids below 32768)."""
    return ipaddress.IPv4Network(f"10.{128 + pid // 256 % 128}.{pid % 256}.0/24")


class Node:
    """One simulated machine; made by `simulated_nodes`, valid inside its `with` block.

    Attributes:
        index: position in the list `simulated_nodes` yields (0, 1, ...).
        address: its IPv4 address (a string), on ``eth0``; the same after a restart.
        hostname: its hostname, which every node resolves to `address`.
        netns: the name of its network namespace (``ip -n NAME ...``).
        veth: the host end of its link (``tc qdisc add dev VETH ...`` shapes traffic to it).
        bridge: the bridge every node's veth is attached to.
    """

    def __init__(
        self,
        index: int,
        *,
        tag: str,
        address: str,
        shm_size: str,
        hosts_file: Path,
    ) -> None:
        self.index = index
        self.address = address
        self.netns = f"{tag}n{index}"
        self.hostname = self.netns
        self.veth = f"{tag}v{index}"
        self.bridge = f"{tag}br"
        self._shm_size = shm_size
        self._hosts_file = hosts_file
        self._keeper: subprocess.Popen[bytes] | None = None
        self._mount_ns: int | None = None  # inode of the mount namespace of the last keeper
        self._started: list[subprocess.Popen[Any]] = []  # reaped when the node fails

    def __repr__(self) -> str:
        state = "up" if self.is_up else "down"
        return f"<Node {self.index} {self.address} {self.netns} {state}>"

    @property
    def is_up(self) -> bool:
        """Whether the node's keeper runs (its /dev/shm exists)."""
        return self._keeper is not None and self._keeper.poll() is None

    @property
    def shm_dir(self) -> Path:
        """The node's /dev/shm seen from the host (through its keeper's root; valid while up)."""
        return Path(f"/proc/{self._up_keeper().pid}/root/dev/shm")

    def shm_files(self) -> list[str]:
        """Sorted names of the files in the node's /dev/shm."""
        return sorted(entry.name for entry in self.shm_dir.iterdir())

    def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        **popen_options: Any,
    ) -> subprocess.Popen[Any]:
        """Start `argv` on the node (in its network, UTS and mount namespaces) and return it.

        The Popen's pid is the command's own (nsenter execs it). `cwd` defaults to this process's
        working directory (the node sees the host's files, but its own /dev/shm). `env`, `stdout`
        and `stderr` default to this process's, as with Popen; other options go to Popen. The
        process is SIGKILLed and reaped when the node fails or the harness exits.
        """
        keeper = self._up_keeper()
        workdir = os.fspath(cwd) if cwd is not None else str(Path.cwd())
        command = [
            "nsenter", f"--target={keeper.pid}", "--mount", "--net", "--uts",
            f"--wdns={workdir}", "--", *argv,
        ]  # fmt: skip
        process = subprocess.Popen(
            command, env=None if env is None else dict(env), stdout=stdout, stderr=stderr,
            **popen_options,
        )  # fmt: skip
        self._started = [p for p in self._started if p.poll() is None]
        self._started.append(process)
        logger.debug("node %d: started pid %d: %s", self.index, process.pid, list(argv))
        return process

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        input: str | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` on the node to its end, its output captured as text.

        Raises subprocess.TimeoutExpired (after killing it) past `timeout` seconds, and
        subprocess.CalledProcessError on a non-zero exit when `check`.
        """
        process = self.start(
            argv, env=env, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        )  # fmt: skip
        try:
            out, err = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate(timeout=COMMAND_TIMEOUT)
            raise
        done = subprocess.CompletedProcess(list(argv), process.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def processes(self) -> list[int]:
        """Pids of every process of the node (its network or mount namespace), keeper included."""
        wanted: set[tuple[str, int]] = set()
        with contextlib.suppress(FileNotFoundError):  # deleted: only the mount namespace is left
            wanted.add(("net", (NETNS_DIR / self.netns).stat().st_ino))
        if self._mount_ns is not None:
            wanted.add(("mnt", self._mount_ns))
        return members(wanted)

    def fail(self, timeout: float = FAIL_TIMEOUT) -> None:
        """Lose the node: SIGKILL every process of it until none is left (at most `timeout` s),
        which unmounts its /dev/shm. Raises RuntimeError when some survive (D state)."""
        deadline = time.monotonic() + timeout
        killed: set[int] = set()
        while pids := self.processes():
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {self.index}: processes {pids} survive SIGKILL")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(pids)
            self._reap()
            time.sleep(0.01)  # a process may fork while it is killed: look again
        # Out of its namespaces is not yet dead: a killed process leaves them before it exits.
        for process in [*self._started, self._keeper]:
            if process is not None:
                process.kill()  # started here, even if it left the node's namespaces since
                process.wait(timeout=max(deadline - time.monotonic(), 1.0))
        while living := [pid for pid in killed if _alive(pid)]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {self.index}: processes {living} survive SIGKILL")
            time.sleep(0.01)
        self._keeper = None
        self._mount_ns = None  # gone with its last process: the kernel may reuse its number
        self._started.clear()
        logger.debug("node %d failed: killed %d processes", self.index, len(killed))

    def up(self) -> None:
        """Bring the node up: a fresh keeper with an empty /dev/shm of its own (raises
        RuntimeError when it does not come up within UP_TIMEOUT s)."""
        if self.is_up:
            raise RuntimeError(f"node {self.index} is already up")
        began = time.monotonic()
        script = (
            'echo "$1" > /proc/sys/kernel/hostname && mount --bind "$2" /etc/hosts && '
            'mount -t tmpfs -o size="$3" tmpfs /dev/shm && echo up && '
            "exec sleep infinity </dev/null >/dev/null 2>&1"
        )
        # `ip netns exec` mounts a /sys of the node's network; unshare then copies that mount
        # tree, privately, for the node's own /dev/shm and /etc/hosts.
        keeper = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--uts", "--propagation",
             "private", "sh", "-c", script, "keeper", self.hostname, str(self._hosts_file),
             self._shm_size],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
            start_new_session=True,  # a Ctrl-C of the test must not lose the node before teardown
        )  # fmt: skip
        assert keeper.stdout is not None
        assert keeper.stderr is not None
        try:
            ready, _, _ = select.select([keeper.stdout], [], [], UP_TIMEOUT)
            said = os.read(keeper.stdout.fileno(), 64) if ready else b""
            if said != b"up\n":
                if keeper.poll() is None:
                    keeper.kill()
                keeper.wait(timeout=COMMAND_TIMEOUT)
                error = keeper.stderr.read().decode(errors="replace").strip()
                why = error or ("timed out" if not ready else f"exit status {keeper.returncode}")
                raise RuntimeError(f"node {self.index} did not come up: {why}")
            self._mount_ns = Path(f"/proc/{keeper.pid}/ns/mnt").stat().st_ino
        finally:
            keeper.stdout.close()
            keeper.stderr.close()
        self._keeper = keeper
        logger.debug("node %d up in %.3f s", self.index, time.monotonic() - began)

    def restart(self) -> None:
        """Fail the node (if up) and bring it up again, as a replaced machine."""
        self.fail()
        self.up()

    def _up_keeper(self) -> subprocess.Popen[bytes]:
        if self._keeper is None or self._keeper.poll() is not None:
            raise RuntimeError(f"node {self.index} is down")
        return self._keeper

    def _reap(self) -> None:
        for process in [*self._started, self._keeper]:
            if process is not None:
                process.poll()

    def _wire(self, subnet: ipaddress.IPv4Network) -> None:
        """Make the namespace and its veth pair, address and links up."""
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        _ip("link", "set", self.veth, "master", self.bridge, "up")
        _ip("addr", "add", f"{self.address}/{subnet.prefixlen}", "dev", "eth0", netns=self.netns)
        _ip("link", "set", "eth0", "up", netns=self.netns)
        _ip("link", "set", "lo", "up", netns=self.netns)

    def _remove(self) -> None:
        """Kill every process of the node and delete its veth pair and namespace."""
        self.fail()
        if Path(f"/sys/class/net/{self.veth}").exists():
            _ip("link", "del", self.veth)  # both ends now: a namespace is freed asynchronously
        if (NETNS_DIR / self.netns).exists():
            _ip("netns", "del", self.netns)


@contextlib.contextmanager
def simulated_nodes(count: int, *, shm_size: str = "1g") -> Iterator[list[Node]]:
    """Bring up `count` simulated nodes on one bridge; yields them, all up.

    Args:
        count: how many nodes (1 to MAX_NODES); node i gets host number i + 1 of the subnet.
        shm_size: size of each node's /dev/shm tmpfs (mount's ``size=``: "1g", "512m", "50%").

    Raises:
        SimulatedNodesUnavailable: where `unavailable()` gives a reason.
        RuntimeError: when a step of the setup fails (the command and its error in the message).

    On exit, even after an error, every process of every node is killed and the namespaces,
    veths and bridge are deleted.
    """
    if not 1 <= count <= MAX_NODES:
        raise ValueError(f"count must be 1 to {MAX_NODES}, not {count}")
    reason = unavailable()
    if reason is not None:
        raise SimulatedNodesUnavailable(reason)
    pid = os.getpid()
    tag = f"{PREFIX}{pid}{string.ascii_lowercase[next(_instances) % 26]}"
    remove_leftovers(own_tag=tag)
    subnet = subnet_of(pid)
    hosts_dir = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
    hosts_file = hosts_dir / "hosts"
    nodes = [
        Node(i, tag=tag, address=str(subnet[i + 1]), shm_size=shm_size, hosts_file=hosts_file)
        for i in range(count)
    ]  # fmt: skip
    bridge = f"{tag}br"
    began = time.monotonic()
    body_failed = False
    try:
        hosts_file.write_text(
            "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
            + "".join(f"{node.address} {node.hostname}\n" for node in nodes)
        )
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for node in nodes:
            node._wire(subnet)
        for node in nodes:
            node.up()
        logger.debug("%d nodes on %s up in %.3f s", count, subnet, time.monotonic() - began)
        yield nodes
    except BaseException:
        body_failed = True
        raise
    finally:
        errors = _tear_down(nodes, bridge, hosts_dir)
        if errors and not body_failed:
            raise RuntimeError(f"tearing down simulated nodes failed: {errors}") from errors[0]


def _tear_down(nodes: list[Node], bridge: str, hosts_dir: Path) -> list[Exception]:
    """Remove every node, then the bridge and the hosts file; returns the errors (logged)."""
    errors: list[Exception] = []
    steps = [node._remove for node in nodes]
    steps.append(lambda: _delete_link(bridge))
    steps.append(lambda: shutil.rmtree(hosts_dir, ignore_errors=True))
    for step in steps:
        try:
            step()
        except Exception as exc:
            logger.error("tearing down simulated nodes: %s", exc)
            errors.append(exc)
    return errors


def remove_leftovers(own_tag: str = "") -> None:
    """Delete namespaces, links and hosts files that a harness left when its process died
    (SIGKILL, a crash), killing the processes still in those namespaces. Also removes those of
    `own_tag`, which only a dead process with this pid can have left."""

    def stale(match: re.Match[str] | None) -> bool:
        if match is None:
            return False
        if f"{PREFIX}{match[1]}{match[2]}" == own_tag:
            return True
        return not Path(f"/proc/{match[1]}").exists()

    if NETNS_DIR.is_dir():
        for entry in NETNS_DIR.iterdir():
            if stale(_NETNS_NAME.match(entry.name)):
                logger.info("removing the leftover network namespace %s", entry.name)
                with contextlib.suppress(FileNotFoundError):
                    for pid in members({("net", entry.stat().st_ino)}):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                _removing_leftover(_ip, "netns", "del", entry.name)
    links = re.findall(r"^\d+: ([^:@\s]+)", _ip("-o", "link", "show"), flags=re.MULTILINE)
    # Veths before bridges: deleting a veth deletes its peer in a namespace too.
    for name in sorted(links, key=lambda n: n.endswith("br")):
        if stale(_LINK_NAME.match(name)):
            logger.info("removing the leftover link %s", name)
            _removing_leftover(_delete_link, name)
    for entry in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        if entry.is_dir() and stale(_HOSTS_DIR_NAME.match(entry.name)):
            shutil.rmtree(entry, ignore_errors=True)


def _removing_leftover(remove: Any, *args: str) -> None:
    """Another harness starting meanwhile may remove the same leftover first: only log."""
    try:
        remove(*args)
    except RuntimeError as exc:
        logger.warning("could not remove a leftover of simulated nodes: %s", exc)


def members(namespaces: set[tuple[str, int]]) -> list[int]:
    """Sorted pids of the processes in any of `namespaces`, each a (kind, inode) pair such as
    ("net", 4026532301) (kinds as in /proc/<pid>/ns/)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _in_namespaces(Path(entry.path), namespaces):
            found.append(int(entry.name))
    return sorted(found)


def _in_namespaces(process: Path, namespaces: set[tuple[str, int]]) -> bool:
    """Whether the process at `process` (/proc/<pid>) is in any of `namespaces`."""
    kinds = {kind for kind, _ in namespaces}
    found = {(kind, _namespace(process, kind)) for kind in kinds}
    if found & namespaces:
        return True
    if all(inode is not None for _, inode in found):
        return False
    # Its main thread exited (killed) while other threads may still run in the namespaces.
    try:
        tasks = list((process / "task").iterdir())
    except OSError:
        return False
    return any((kind, _namespace(task, kind)) in namespaces for task in tasks for kind in kinds)


def _namespace(task: Path, kind: str) -> int | None:
    """The inode of the namespace of `kind` of a /proc/<pid> or task folder, None once exited."""
    try:
        return (task / "ns" / kind).stat().st_ino
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _delete_link(name: str) -> None:
    if Path(f"/sys/class/net/{name}").exists():
        _ip("link", "del", name)


def _ip(*args: str, netns: str | None = None) -> str:
    """Run one `ip` command (in the namespace `netns` if given); its output, or RuntimeError."""
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"`{' '.join(argv)}` timed out after {COMMAND_TIMEOUT} s") from exc
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout
