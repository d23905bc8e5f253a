"""A real S3 API server for the tests (moto in server mode on 127.0.0.1, in this process), a
proxy in front of it that throttles, delays or drops requests as a troubled service would, and
the fixtures of the object storage tests (a plugin of tests/conftest.py): one server per test
process, a bucket of its own per test, the AWS settings pointing at the server.

moto takes parts of any size from 1 KiB (S3 takes 5 MiB), so small states make multipart
uploads of many parts. The proxy is not a mock of anything: it passes every request it does not
fault to the server and its answer back, byte for byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

logging.getLogger("werkzeug").setLevel(logging.ERROR)

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please '
    b"reduce your request rate.</Message><RequestId>proxy</RequestId></Error>"
)


class MotoServer:
    """moto's S3 server on 127.0.0.1; `stop` and `start` again keep the port and the data (the
    data lives in this process, as a real service's lives on its disks)."""

    def __init__(self) -> None:
        self.port = 0
        self._server: Any = None
        self.start()

    def start(self) -> None:
        os.environ.setdefault("S3_UPLOAD_PART_MIN_SIZE", "1024")  # read when moto is imported
        from moto.server import ThreadedMotoServer

        for _ in range(50):
            try:
                server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
                server.start()
                break
            except OSError:  # the old listener's port is not free yet
                time.sleep(0.1)
        else:
            raise RuntimeError(f"moto could not listen on port {self.port} again")
        self._server = server
        self.port = server.get_host_and_port()[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class FaultProxy:
    """An HTTP proxy to `upstream`: answers 503 SlowDown to every `throttle_every`-th request
    (0: none) and to every request whose path and query contain `throttle_matching` (None:
    none), waits `delay` seconds before passing each request on, with `drop` set closes each
    connection without an answer (a server that went away mid-request), and cuts the next
    `cut_reads` answers to GETs of ``.safetensors`` objects off halfway through their body (a
    connection reset while a load reads)."""

    def __init__(self, upstream: str, *, throttle_every: int = 0, delay: float = 0.0) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.throttle_every = throttle_every
        self.delay = delay
        self.drop = False
        self.cut_reads = 0
        self.throttle_matching: str | None = None
        self.requests = 0
        self.throttled = 0
        self.read_bytes = 0  # bytes of .safetensors objects answered to GETs

        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    proxy.requests += 1
                    throttle = (
                        proxy.throttle_every and proxy.requests % proxy.throttle_every == 0
                    ) or (
                        proxy.throttle_matching is not None and proxy.throttle_matching in self.path
                    )
                    proxy.throttled += bool(throttle)
                if proxy.delay:
                    time.sleep(proxy.delay)
                if proxy.drop:
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if throttle:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items()}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                except OSError:
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                finally:
                    upstream.close()
                cut = False
                if self.command == "GET" and ".safetensors" in self.path:
                    with proxy._lock:
                        proxy.read_bytes += len(data)
                        cut = proxy.cut_reads > 0 and len(data) > 1
                        proxy.cut_reads -= cut

                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if cut:  # half the body, then the connection is gone
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def point_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """The AWS settings of this process (and the writers it starts) for the server at `endpoint`."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)


# -- fixtures (a plugin of tests/conftest.py) ---------------------------------------------

_buckets = itertools.count()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer()
    yield server
    server.stop()


@dataclasses.dataclass
class Bucket:
    name: str
    server: MotoServer

    def url(self, prefix: str = "run") -> str:
        return f"s3://{self.name}/{prefix}" if prefix else f"s3://{self.name}"

    @property
    def client(self) -> Any:
        from pyshmckpt.storage.stores import s3

        return s3.client()

    def keys(self, prefix: str = "") -> list[str]:
        listed = self.client.list_objects_v2(Bucket=self.name, Prefix=prefix)
        return sorted(entry["Key"] for entry in listed.get("Contents", []))

    def uploads(self) -> list[str]:
        listed = self.client.list_multipart_uploads(Bucket=self.name)
        return sorted(entry["Key"] for entry in listed.get("Uploads", []))


@pytest.fixture
def bucket(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A new bucket; parts of 64 KiB, so that small states upload in many parts."""
    point_at(monkeypatch, moto_server.endpoint)
    monkeypatch.setenv("PYSHMCKPT_OBJECT_PART_SIZE", str(64 << 10))
    made = Bucket(f"ckpt-{os.getpid()}-{next(_buckets)}", moto_server)
    made.client.create_bucket(Bucket=made.name)
    return made
