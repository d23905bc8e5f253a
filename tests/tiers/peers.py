"""Parts of the tests of the wire between nodes: a listener on loopback, a checkpoint staged and
described as a writer holds it, a man in the middle, and a CRC32C-preserving byte flip."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from pyshmckpt.shm.native import crc32c
from pyshmckpt.tiers import records, replicas, wire
from pyshmckpt.tiers.records import HoldInfo

TIMEOUT = 30.0


class Server:
    """A `wire.Listener` on a loopback port calling `handle(channel)`; what each call returned
    or raised lands in `results` (in order)."""

    def __init__(self, handle: Callable[[wire.Channel], Any], secret: str, **options: Any) -> None:
        sock = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = sock.getsockname()[:2]
        self.me = wire.identity("test-server", address=self.address)
        self.results: list[Any] = []
        self.done = threading.Semaphore(0)

        def run(channel: wire.Channel) -> None:
            try:
                self.results.append(handle(channel))
            except BaseException as exc:  # noqa: BLE001 - examined by the test
                self.results.append(exc)
            finally:
                self.done.release()

        self.listener = wire.Listener(sock, secret, self.me, run, name="test-listener", **options)

    def result(self, timeout: float = TIMEOUT) -> Any:
        """The outcome of the next session to end."""
        if not self.done.acquire(timeout=timeout):
            raise TimeoutError("no session ended in time")
        return self.results.pop(0)

    def connect(self, secret: str, **options: Any) -> wire.Channel:
        return wire.connect(
            self.address, secret, wire.Deadline(TIMEOUT), client="test-client", server=self.me,
            **options,
        )  # fmt: skip

    def close(self) -> None:
        self.listener.close(TIMEOUT)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def echo(channel: wire.Channel) -> dict[str, Any]:
    """A session that answers one message with itself."""
    message = channel.recv_message(wire.Deadline(TIMEOUT))
    channel.send_message({"echo": message}, wire.Deadline(TIMEOUT))
    return message


def receive(channel: wire.Channel, **expect: Any) -> tuple[dict[str, Any], Any]:
    """A session that receives a replica, then frees its segment; (record, landed bytes)."""
    record, segment = replicas.receive(channel, wire.Deadline(TIMEOUT), **expect)
    try:
        start = segment.data_offset
        landed = bytes(memoryview(segment)[start : start + int(record["data_bytes"])])
    finally:
        segment.unlink()
        segment.close()
    with contextlib.suppress(wire.ReplicationError):
        channel.send_message({"ok": True}, wire.Deadline(TIMEOUT))
    return record, landed


@contextlib.contextmanager
def held_checkpoint(values: np.ndarray, name: str = "s3", staged_ns: int = 7) -> Iterator[Any]:
    """A checkpoint of `values` (as tensor "w") staged into a segment of ours, described as its
    writer holds it (rank 2 of 4 of root "/r"); yields its record."""
    import torch

    from pyshmckpt.shm import AttachedSegments
    from pyshmckpt.staging import SlotStager

    stager = SlotStager(slots=1)
    staged = stager.stage({"w": torch.from_numpy(values), "step": 3})
    attached = AttachedSegments()
    try:
        handle = stager.handle(staged)
        attached.sync(handle.segments())
        mapping = attached.slot(handle.address, handle.manifest.size)
        info = HoldInfo("/r", 2, 4, name, staged_ns, False, 60.0, None, False)
        address = handle.address
        segment = (address.name, address.size, address.token)
        yield records.describe(handle.manifest, mapping, info, segment)
    finally:
        attached.sync([])
        del staged
        stager.close()


def data_of(record: dict[str, Any]) -> bytes:
    """The bytes a held checkpoint's record describes, read from its segment."""
    from pyshmckpt.shm.stale import SHM_DIR

    with (SHM_DIR / record["segment"]["name"]).open("rb") as f:
        f.seek(int(record["segment"]["offset"]))
        return f.read(int(record["data_bytes"]))


def entry_range(record: dict[str, Any], name: str) -> tuple[int, int]:
    """(offset from the data's start, length) of entry `name`."""
    names, rows, _ = replicas.check_record(
        {k: v for k, v in record.items() if k not in ("segment",)}
    )
    return rows[names.index(name)]


def flip_keeping_crc(data: bytearray, at: int, fix_at: int, end: int, start: int = 0) -> None:
    """Flip a bit of `data[at]` and change the 4 bytes at `fix_at` so that the CRC32C of
    `data[start:end]` stays what it was (CRC32C is linear: a check it passes is no proof)."""
    n = end - start
    zero = crc32c(bytes(n))

    def effect(changes: dict[int, int]) -> int:
        delta = bytearray(n)
        for pos, bits in changes.items():
            delta[pos - start] ^= bits
        return crc32c(bytes(delta)) ^ zero

    target = effect({at: 0x10})
    pivots: dict[int, tuple[int, int]] = {}
    for i in range(32):
        vector, mask = effect({fix_at + i // 8: 1 << (i % 8)}), 1 << i
        while vector:
            top = vector.bit_length() - 1
            if top not in pivots:
                pivots[top] = (vector, mask)
                break
            vector, mask = vector ^ pivots[top][0], mask ^ pivots[top][1]
    chosen = 0
    while target:
        vector, mask = pivots[target.bit_length() - 1]
        target, chosen = target ^ vector, chosen ^ mask
    before = crc32c(bytes(data[start:end]))
    data[at] ^= 0x10
    for i in range(32):
        if chosen >> i & 1:
            data[fix_at + i // 8] ^= 1 << (i % 8)
    after = crc32c(bytes(data[start:end]))
    if after != before:
        raise RuntimeError("the CRC32C was not kept")


_LENGTH = struct.Struct("!I")
_SHORT = struct.Struct("!H")


class Proxy:
    """A man in the middle on a loopback port: relays one connection to `target`, passing the
    client's first message after the handshake (a whole frame: length, body, tag) through
    `tamper_frame`, and the bytes of the checkpoint that follow it (with their tags removed,
    put back unchanged) through `tamper_data`; everything else is relayed as it is. `overhead`:
    the bytes of a tag in the suite the client asks for; `data_bytes`: how many bytes follow the
    first message (read from it when not given: it is not encrypted)."""

    def __init__(
        self,
        target: tuple[str, int],
        overhead: int,
        tamper_frame: Callable[[bytes], bytes] = lambda frame: frame,
        tamper_data: Callable[[bytearray], None] = lambda data: None,
        data_bytes: int | None = None,
    ) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(TIMEOUT)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self.frames: list[bytes] = []  # the client's first frame as it came
        self.streamed = bytearray()  # every byte the client sent after the handshake
        self._target = target
        self._overhead = overhead
        self._tamper_frame = tamper_frame
        self._tamper_data = tamper_data
        self._data_bytes = data_bytes
        self._threads: list[threading.Thread] = []
        self.error: BaseException | None = None
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _run(self) -> None:
        try:
            client, _ = self._sock.accept()
        except OSError as exc:
            self.error = exc
            return
        server = socket.create_connection(self._target, timeout=TIMEOUT)
        client.settimeout(TIMEOUT)
        back = threading.Thread(target=_pipe, args=(server, client), daemon=True)
        back.start()
        self._threads.append(back)
        with client, server:
            try:
                self._forward(client, server)
            except OSError as exc:
                self.error = exc
            back.join(TIMEOUT)

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        head = _read(client, 32 + _SHORT.size)  # the client's nonce and the hello's length
        (length,) = _SHORT.unpack_from(head, 32)
        server.sendall(head + _read(client, length + 32))
        raw = _read(client, _LENGTH.size)
        if not raw:
            return
        (length,) = _LENGTH.unpack(raw)
        frame = raw + _read(client, length + self._overhead)
        self.frames.append(frame)
        self.streamed += frame
        server.sendall(self._tamper_frame(frame))
        total = self._data_bytes
        if total is None:
            try:
                record = json.loads(frame[_LENGTH.size : _LENGTH.size + length])["record"]
                total = int(record["data_bytes"])
            except (ValueError, KeyError, TypeError):  # not a record: relay the rest as it is
                total = 0
        pieces, tags = [], []
        for start in range(0, total, wire.CHUNK):
            n = min(wire.CHUNK, total - start)
            pieces.append(_read(client, n))
            tags.append(_read(client, self._overhead))
            self.streamed += pieces[-1] + tags[-1]
        if total:
            data = bytearray(b"".join(pieces))
            self._tamper_data(data)
            for i, tag in enumerate(tags):
                server.sendall(bytes(data[i * wire.CHUNK : (i + 1) * wire.CHUNK]) + tag)
        _pipe(client, server, self.streamed)

    def close(self) -> None:
        self._sock.close()
        for thread in self._threads:
            thread.join(TIMEOUT)


def _read(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _pipe(source: socket.socket, sink: socket.socket, copy: bytearray | None = None) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(1 << 16):
            if copy is not None:
                copy += chunk
            sink.sendall(chunk)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def reframed(frame: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    """A message frame whose JSON body is changed by `change` and its length fixed, its tag
    kept (only the key of the connection could make a new one)."""
    (length,) = _LENGTH.unpack_from(frame)
    body = json.loads(frame[_LENGTH.size : _LENGTH.size + length])
    change(body)
    new = json.dumps(body, separators=(",", ":")).encode()
    return _LENGTH.pack(len(new)) + new + frame[_LENGTH.size + length :]
