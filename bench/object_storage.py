"""Object storage (S3 API): a save to an ``s3://`` root and a load from it, against boto3's own
best upload and download of the same bytes, through one local S3 server in the same run.

    python bench/object_storage.py                          # 1 GiB in 8,192 tensors, 3 repeats
    python bench/object_storage.py --shared-bytes           # moto without its copy per GET
    python bench/object_storage.py --size 256MiB --repeats 2          # quick check
    python bench/object_storage.py --tensors 8192 1 --json out.json  # also 1 GiB as one tensor
    python bench/object_storage.py --server thread          # moto inside this process instead

The script starts moto's S3 server (``python -m moto.server`` on 127.0.0.1, a process of its own,
so it shares no GIL with either client; ``--server thread`` runs it in this process), with its
objects kept in memory (``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE`` above the object size: no disk in the
way), and makes a bucket there. moto copies the whole object out of its buffer for every GET,
also for a ranged GET of one part (a 1 GiB object read in 32 MiB ranges costs it 32 GiB of
copies); with --shared-bytes its server runs with that one change (``FakeKey.value`` hands each
GET the stored bytes as they are), so that the clients' own costs show. The state is --size
bytes in --tensors equal float32 tensors. Part size and parts in flight are pyshmckpt's
settings (``PYSHMCKPT_OBJECT_PART_SIZE``, default 32 MiB; ``PYSHMCKPT_OBJECT_CONCURRENCY``,
default 16), and boto3 is given the same through ``TransferConfig(multipart_chunksize=,
multipart_threshold=, max_concurrency=)``. After a warm-up (two saves to each root, one boto3
download and upload, one load), every way runs --repeats times in a rotating order, each once
the server has used no CPU for 0.3 s; each figure is the median:

* ``save``         ``Checkpointer("s3://...", keep_last=1).save(state)``: the time save() blocks
                   the caller (staging into the slot) and the time until its Future resolves
                   (every part uploaded with its CRC32C, the manifest, the commit record and
                   ``latest`` written: committed)
* ``upload_file``  boto3 ``client.upload_file`` of the same bytes (the ``rank0.safetensors``
                   object ours wrote, downloaded once to /dev/shm), with boto3's default request
                   checksums (a CRC32 per part); ``upload_file_nocrc`` the same with
                   ``request_checksum_calculation="when_required"`` (none). The faster of the two
                   is boto3's best.
* ``load``         ``pyshmckpt.load("s3://...")`` until the state dict is returned (parallel
                   ranged GETs, every entry's CRC32C checked)
* ``download_file``    boto3 ``client.download_file`` to a file on /dev/shm (boto3's best download)
* ``download_fileobj`` boto3 ``client.download_fileobj`` into a ``BytesIO``
* ``local_save``   the same state saved by a Checkpointer on a local directory (--dir): the time
                   save() blocks, against which the ``s3://`` root's is compared

Goals: upload_file (boto3's best) / save-to-committed >= 1.0, download_file / load >= 1.0, and
the time save() blocks with an ``s3://`` root about that with a local directory (the upload runs
in the writer). Per way the server's CPU seconds are given too (from /proc of its process;
``--server process`` only): the server is Python and shares this machine's cores with both
clients.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
TIMEOUT = 900  # seconds one save, upload or download may take
BUCKET = "pyshmckpt-bench"
WAYS = ("save", "upload_file", "upload_file_nocrc", "load", "download_file",
        "download_fileobj", "local_save")  # fmt: skip


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(MiB|GiB)", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"a size like 256MiB or 1GiB, not {text!r}")
    return int(float(match[1]) * (MIB if match[2] == "MiB" else GIB))


# -- the server ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_settings(nbytes: int, part: int) -> dict[str, str]:
    """moto's settings: objects in memory (no spill to disk below 2x the object), and parts as
    small as ours where they are below S3's 5 MiB."""
    return {
        "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(2 * nbytes + 64 * MIB),
        "S3_UPLOAD_PART_MIN_SIZE": str(min(part, 5 * MIB)),
    }


# moto's server with one change: an object's stored bytes are handed out as they are (moto
# copies the whole object out of its buffer for every GET, also for a ranged GET of a part).
SHARED_SERVER = """
import io, sys
from moto.s3 import models

def value(self):
    with self.lock:
        if isinstance(self._value_buffer._file, io.BytesIO):
            return self._value_buffer._file.getvalue()  # the buffer's bytes, not a copy
        self._value_buffer.seek(0)
        return self._value_buffer.read()

models.FakeKey.value = property(value, models.FakeKey.value.fset)
from moto.server import main
main(sys.argv[1:])
"""


@contextlib.contextmanager
def moto_server(
    kind: str, settings: dict[str, str], shared: bool = False
) -> Iterator[tuple[str, int | None]]:
    """moto's S3 server on 127.0.0.1 until the block ends: (endpoint, pid of its process or
    None when it runs in this process); with `shared`, objects' bytes are not copied per GET."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    if kind == "thread":
        if shared:
            raise SystemExit("--shared-bytes needs --server process")
        os.environ.update(settings)  # read when moto is imported
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            yield endpoint, None
        finally:
            server.stop()
        return
    command = ["-c", SHARED_SERVER] if shared else ["-m", "moto.server"]
    process = subprocess.Popen(
        [sys.executable, *command, "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **settings}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=5).close()
                break
            except OSError as exc:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"moto's server did not start ({exc})") from None
                time.sleep(0.2)
        yield endpoint, process.pid
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (nan for none)."""
    if pid is None:
        return float("nan")
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(pid: int | None, quiet: float = 0.3, bound: float = 30.0) -> None:
    """Wait (at most `bound` seconds) until the server has used no CPU for `quiet` seconds: what
    the previous way left it doing (freeing a replaced object, a deletion) is not charged to the
    next."""
    if pid is None:
        return
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(quiet)
        if cpu_seconds(pid) == before:
            return


def rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- the ways -----------------------------------------------------------------------------------


def make_state(nbytes: int, tensors: int) -> dict[str, Any]:
    import torch

    numel = nbytes // 4 // tensors
    return {f"layer{i}.weight": torch.randn(numel) for i in range(tensors)}


def boto3_client(checksums: bool) -> Any:
    """boto3's client as a user of its transfer manager would make it: enough connections for
    the parts in flight, and boto3's default request checksums or none."""
    import boto3
    import botocore.config

    from pyshmckpt import knobs

    config = botocore.config.Config(
        max_pool_connections=max(32, 2 * knobs.object_concurrency()),
        request_checksum_calculation="when_supported" if checksums else "when_required",
    )
    return boto3.session.Session().client("s3", config=config)


def transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    from pyshmckpt import knobs

    part = knobs.object_part_size()
    return TransferConfig(
        multipart_threshold=part, multipart_chunksize=part,
        max_concurrency=knobs.object_concurrency(), use_threads=True,
    )  # fmt: skip


class Case:
    """One state, its two Checkpointers and boto3's clients; each way a method returning
    {"seconds": ..., and maybe "blocked": ...}."""

    def __init__(self, nbytes: int, tensors: int, workdir: Path, root: str) -> None:
        import pyshmckpt

        self.state = make_state(nbytes, tensors)
        self.nbytes = sum(t.nbytes for t in self.state.values())
        self.tensors = tensors
        self.root = root
        self.s3 = pyshmckpt.Checkpointer(root, keep_last=1)
        self.local_root = Path(tempfile.mkdtemp(prefix="local-", dir=workdir))
        self.local = pyshmckpt.Checkpointer(self.local_root, keep_last=1)
        self.file = Path(tempfile.mkdtemp(prefix="pyshmckpt-objbench-", dir="/dev/shm"))
        self.clients = {True: boto3_client(True), False: boto3_client(False)}
        self.config = transfer_config()
        self.key = f"{root.split('/', 3)[3]}-boto3/rank0.safetensors"
        self.object_key = ""  # ours, once saved

    def close(self) -> None:
        try:
            self.s3.close()
        finally:
            self.local.close()
            shutil.rmtree(self.local_root, ignore_errors=True)
            shutil.rmtree(self.file, ignore_errors=True)
            self.state.clear()  # the next case's state is made while this object lives
            self._remove_objects()

    def _remove_objects(self) -> None:
        """Delete this case's objects: the server holds them in its memory."""
        client = self.clients[False]
        name = self.root.split("/", 3)[3]
        for prefix in (f"{name}/", f"{name}-boto3/"):
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for page in pages:
                keys = [{"Key": entry["Key"]} for entry in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})

    def _save(self, checkpointer: Any) -> dict[str, float]:
        started = time.perf_counter()
        future = checkpointer.save(self.state)
        blocked = time.perf_counter() - started
        where = future.result(timeout=TIMEOUT)
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "blocked": blocked, "where": str(where)}  # type: ignore[dict-item]

    def save(self) -> dict[str, float]:
        done = self._save(self.s3)
        self.object_key = f"{str(done['where']).split('/', 3)[3]}/rank0.safetensors"
        return done

    def local_save(self) -> dict[str, float]:
        return self._save(self.local)

    def fetch_ours(self) -> Path:
        """Ours' data object as a file on /dev/shm (boto3's upload source)."""
        path = self.file / "rank0.safetensors"
        self.clients[True].download_file(BUCKET, self.object_key, str(path), Config=self.config)
        return path

    def _upload(self, checksums: bool) -> dict[str, float]:
        source = self.file / "rank0.safetensors"
        started = time.perf_counter()
        self.clients[checksums].upload_file(str(source), BUCKET, self.key, Config=self.config)
        return {"seconds": time.perf_counter() - started}

    def upload_file(self) -> dict[str, float]:
        return self._upload(True)

    def upload_file_nocrc(self) -> dict[str, float]:
        return self._upload(False)

    def load(self) -> dict[str, float]:
        import pyshmckpt

        started = time.perf_counter()
        state = pyshmckpt.load(self.root)
        seconds = time.perf_counter() - started
        got = sum(t.nbytes for t in state.values())
        if len(state) != self.tensors or got != self.nbytes:
            raise SystemExit(f"load returned {len(state)} tensors of {got} bytes")
        del state
        return {"seconds": seconds}

    def download_file(self) -> dict[str, float]:
        target = self.file / "downloaded"
        started = time.perf_counter()
        self.clients[True].download_file(BUCKET, self.key, str(target), Config=self.config)
        seconds = time.perf_counter() - started
        target.unlink()
        return {"seconds": seconds}

    def download_fileobj(self) -> dict[str, float]:
        buffer = io.BytesIO()
        started = time.perf_counter()
        self.clients[True].download_fileobj(BUCKET, self.key, buffer, Config=self.config)
        seconds = time.perf_counter() - started
        del buffer
        return {"seconds": seconds}


def measure(case: Case, repeats: int, server_pid: int | None) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}

    def one(way: str) -> dict[str, float]:
        settle(server_pid)
        cpu = cpu_seconds(server_pid)
        done: dict[str, float] = getattr(case, way)()
        done["server_cpu"] = cpu_seconds(server_pid) - cpu
        return done

    # The warm-up: both slots of each Checkpointer; ours' object downloaded (boto3's upload
    # source, and its download path warmed), uploaded (the object boto3's downloads read), loaded.
    for way in ("save", "save", "local_save", "local_save"):
        one(way)
    case.fetch_ours()
    one("upload_file")
    one("load")
    for repeat in range(repeats):
        # a rotating order (the objects each way reads exist since the warm-up)
        for way in WAYS[repeat % len(WAYS) :] + WAYS[: repeat % len(WAYS)]:
            runs[way].append(one(way))
            print(f"repeat {repeat} {way}: {runs[way][-1]}", file=sys.stderr, flush=True)
    return runs


def report(results: dict[str, Any]) -> None:
    print(f"\nmoto's S3 server ({results['server']}), parts of {results['part_size'] // MIB} MiB,"
          f" {results['concurrency']} in flight; medians of {results['repeats']}")  # fmt: skip
    print(f"{'MiB':>6} {'tensors':>7} {'way':18} {'s':>8} {'MiB/s':>8} {'blocked ms':>11}"
          f" {'server cpu s':>13}")  # fmt: skip
    for case in results["cases"]:
        med, size = case["medians"], case["bytes"]
        for way in WAYS:
            m = med[way]
            blocked = f"{m['blocked'] * 1e3:11.1f}" if "blocked" in m else f"{'':>11}"
            print(f"{size / MIB:6.0f} {case['tensors']:7d} {way:18} {m['seconds']:8.2f}"
                  f" {size / MIB / m['seconds']:8.0f} {blocked} {m['server_cpu']:13.2f}")  # fmt: skip
    print(f"\n{'MiB':>6} {'tensors':>7} {'upload: boto3 best / save':>27} {'goal':>6}"
          f" {'load: download_file / load':>27} {'goal':>6}"
          f" {'blocked: s3 / local':>20}")  # fmt: skip
    for case in results["cases"]:
        r = case["ratios"]
        print(f"{case['bytes'] / MIB:6.0f} {case['tensors']:7d} {r['upload']:27.2f} {'>= 1':>6}"
              f" {r['load']:27.2f} {'>= 1':>6} {r['blocked']:20.2f}"
              f"  (boto3's best upload: {r['upload_best']})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=GIB, help="state size (default 1GiB)")
    parser.add_argument("--tensors", nargs="+", type=int, default=[8192],
                        help="tensors of the state, one case each (default 8192)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server", choices=("process", "thread"), default="process",
                        help="moto's server in a process of its own or in this one")  # fmt: skip
    parser.add_argument("--shared-bytes", action="store_true",
                        help="moto's server handing out stored bytes without copying them per GET")  # fmt: skip
    parser.add_argument("--dir", default=None, help="the local root's directory (default: a temp)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()

    from pyshmckpt import knobs

    part, concurrency = knobs.object_part_size(), knobs.object_concurrency()
    workdir = Path(tempfile.mkdtemp(prefix="object-storage-", dir=args.dir))
    results: dict[str, Any] = {
        "server": ("python -m moto.server, a process of its own" if args.server == "process"
                   else "ThreadedMotoServer in the benchmark's process")
        + (", stored bytes shared with GETs" if args.shared_bytes else ""),
        "part_size": part, "concurrency": concurrency, "repeats": args.repeats,
        "cpu_count": os.cpu_count(), "cases": [],
        "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
    }  # fmt: skip
    try:
        settings = server_settings(args.size, part)
        with moto_server(args.server, settings, args.shared_bytes) as (endpoint, pid):
            os.environ.update({
                "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
            })  # fmt: skip
            for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
                os.environ.pop(name, None)
            boto3_client(False).create_bucket(Bucket=BUCKET)
            for tensors in args.tensors:
                case = Case(args.size, tensors, workdir, f"s3://{BUCKET}/run-{tensors}")
                try:
                    runs = measure(case, args.repeats, pid)
                finally:
                    case.close()
                medians = {
                    way: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "where"}
                    for way, rs in runs.items()
                }  # fmt: skip
                best_upload = min(medians["upload_file"]["seconds"],
                                  medians["upload_file_nocrc"]["seconds"])  # fmt: skip
                results["cases"].append({
                    "bytes": case.nbytes, "tensors": tensors, "runs": runs, "medians": medians,
                    "ratios": {
                        "upload": best_upload / medians["save"]["seconds"],
                        "upload_best": min(("upload_file", "upload_file_nocrc"),
                                           key=lambda way: medians[way]["seconds"]),
                        "load": medians["download_file"]["seconds"] / medians["load"]["seconds"],
                        "blocked": medians["save"]["blocked"] / medians["local_save"]["blocked"],
                    },
                })  # fmt: skip
            results["server_peak_rss_mib"] = rss_mib(pid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    report(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
