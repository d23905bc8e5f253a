"""Which node each rank runs on, and each rank's buddy: where its checkpoints are replicated.

Learned once, when a replicating `Checkpointer` starts: every rank reserves a port on its node's
address (`wire.node_address`: the interface of the route to torchrun's rendezvous host, or
``PYSHMCKPT_REPLICA_ADDRESS``) and the ranks exchange (rank, address, port) over the process
group, with the job's secret drawn by its first rank. Ranks with the same address are one node;
nodes are ordered by their lowest rank, ranks within a node by rank. The buddy of the j-th rank
of node i is the j-th rank (modulo its size) of node i+1 (the last node's is the first node's):
the same local rank on the next node, so that losing one node loses no checkpoint.

The port is reserved by binding (not listening) with ``SO_REUSEPORT`` in the trainer, and held
while the Checkpointer lives, so that the writer, and a writer restarted after a crash, can
listen on it (only this user can share a reused port), and the other ranks need to learn it
once.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from typing import Any

from ..errors import from_os_error
from . import wire
from .replication import ReplicaConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Peer:
    """A rank's replica listener: its node's address and its port."""

    rank: int
    address: str
    port: int


def reserve_port(address: str) -> socket.socket:
    """A socket bound to a free port of `address`, which the writer can listen on as well.

    Raises:
        OSError: `address` is not one of this node's.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((address, 0))
    except OSError:
        sock.close()
        raise
    return sock


def exchange(rank: int, me: Peer, group: Any) -> tuple[list[Peer], str]:
    """Every rank's `Peer` (ordered by rank) and the job's secret (the first rank's draw), over
    `group`. The secret travels in the process group's own traffic (clear, on most backends).

    Raises:
        ConfigError: encryption between nodes is asked for (``PYSHMCKPT_REPLICA_ENCRYPT``)
            without the `cryptography` package (after the exchange: no rank is left waiting).
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (rank, me.address, me.port, wire.new_secret()), group=group)
    peers = sorted((Peer(int(r), str(a), int(p)) for r, a, p, _ in gathered), key=lambda p: p.rank)
    wire.suites()  # fails now, not at every save
    return peers, str(gathered[0][3])


def nodes(peers: list[Peer]) -> list[list[Peer]]:
    """The ranks grouped by node, nodes ordered by their lowest rank."""
    by_address: dict[str, list[Peer]] = {}
    for peer in sorted(peers, key=lambda p: p.rank):
        by_address.setdefault(peer.address, []).append(peer)
    return sorted(by_address.values(), key=lambda ranks: ranks[0].rank)


def buddy(rank: int, peers: list[Peer]) -> Peer | None:
    """Where rank `rank`'s checkpoints are replicated (None: every rank is on one node)."""
    grouped = nodes(peers)
    if len(grouped) < 2:
        return None
    for index, node in enumerate(grouped):
        for local, peer in enumerate(node):
            if peer.rank == rank:
                following = grouped[(index + 1) % len(grouped)]
                return following[local % len(following)]
    return None


def join(
    rank: int,
    process_group: Any,
    *,
    timeout: float,
    hold_timeout: float,
    agent: tuple[int, int] | None,
    stall_timeout: float | None,
) -> tuple[ReplicaConfig, socket.socket]:
    """Take part in replication as rank `rank` (collective over `process_group`, or a gloo
    group made for it): reserve a port on this node's address, learn every rank's and the
    job's secret, and find this rank's buddy. Returns the config each save of this rank hands
    its writer, and the socket that holds the port reserved (close it when done).

    Raises:
        PyshmckptOSError: the port cannot be reserved on this node's address.
    """
    import torch.distributed as dist

    address = wire.node_address()
    try:
        port_socket = reserve_port(address)
    except OSError as exc:
        raise from_os_error(exc, f"cannot listen for replicas on {address}") from None
    try:
        port = int(port_socket.getsockname()[1])
        group = process_group if process_group is not None else dist.new_group(backend="gloo")
        try:
            peers, secret = exchange(rank, Peer(rank, address, port), group)
        finally:
            if process_group is None:
                dist.destroy_process_group(group)
    except BaseException:
        port_socket.close()
        raise
    mate = buddy(rank, peers)
    if mate is None:
        logger.warning("replicate=True, but every rank runs on one node: nothing is replicated")
    else:
        logger.info(
            "replicating rank %d's checkpoints to rank %d (%s)", rank, mate.rank, mate.address
        )
    config = ReplicaConfig(
        listen=(address, port),
        buddy=(mate.address, mate.port) if mate is not None else None,
        buddy_rank=mate.rank if mate is not None else None,
        secret=secret, timeout=timeout, hold_timeout=hold_timeout, agent=agent,
        stall_timeout=stall_timeout,
    )  # fmt: skip
    return config, port_socket
