"""Fixtures of the object storage tests: one S3 API server per test process (moto, real HTTP on
127.0.0.1), a bucket of its own per test, and the AWS settings pointing at the server."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
from s3servers import MotoServer

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
        from pyshmckpt.storage import object_store

        return object_store.client()

    def keys(self, prefix: str = "") -> list[str]:
        listed = self.client.list_objects_v2(Bucket=self.name, Prefix=prefix)
        return sorted(entry["Key"] for entry in listed.get("Contents", []))

    def uploads(self) -> list[str]:
        listed = self.client.list_multipart_uploads(Bucket=self.name)
        return sorted(entry["Key"] for entry in listed.get("Uploads", []))


def point_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """The AWS settings of this process (and the writers it starts) for the server at `endpoint`."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)


@pytest.fixture
def bucket(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A new bucket; parts of 64 KiB, so that small states upload in many parts."""
    point_at(monkeypatch, moto_server.endpoint)
    monkeypatch.setenv("PYSHMCKPT_OBJECT_PART_SIZE", str(64 << 10))
    made = Bucket(f"ckpt-{os.getpid()}-{next(_buckets)}", moto_server)
    made.client.create_bucket(Bucket=made.name)
    return made
