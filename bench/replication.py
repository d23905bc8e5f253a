"""Replication between two nodes: its throughput against raw TCP over the same link, the
training slowdown it adds, and restoring a replaced node from its peer against from disk.

    python bench/replication.py                        # 256 MiB and 1 GiB, 3 repeats (as root)
    python bench/replication.py --sizes 16MiB --repeats 1 --steps 10 --every 5   # quick check
    python bench/replication.py --measure throughput restore --dir /mnt/nvme --json out.json

Needs root: it runs on two simulated nodes (tests/simnodes.py: each a network namespace with an
address of its own on a bridge and a /dev/shm of its own), brought up once for the whole run;
without them it prints why and exits. Every job is ``torchrun --nnodes 2 --nproc-per-node 1``
(gloo, CPU; c10d rendezvous on node 0's address) of bench/replication_worker.py, one rank per
node; every rank's node-to-node traffic crosses the bridge, all on this machine's cores.

1. Throughput (``throughput``), for each of --sizes: a flat state of that size (--tensors equal
   float32 tensors) per rank, ``Checkpointer(root, replicate=True)``. In every repeat, in a
   rotating order:

   * raw one way: node 0 sends the bytes to node 1 over plain TCP, ``sendfile`` from a file in
     its /dev/shm (as replication sends from a segment); node 1 ``recv_into`` an anonymous buffer
     allocated and faulted in beforehand, then acknowledges with one byte; timed on node 0 from
     the first byte sent to the acknowledgement (connection set-up excluded). The link's speed.
   * replica one way: node 0's rank alone ``save(state, persist=False)``; timed from save()
     returning (the state staged) to its Future resolving: node 0's writer computes every
     entry's CRC32C and sends the slot, node 1's writer receives it into the segment of the
     copy it replaces (a new one the first time), checks every CRC32C, holds it and answers
     (connection and authentication included). Node 1's rank then checks that its node holds
     that replica.
   * raw both ways, replica both ways: the same from both nodes at once, as every rank of a
     job replicates at once (the slower direction's time).

   One raw transfer and one save (both ways) warm up first. Throughput = bytes / median time;
   goal: replica one way >= 0.8x raw one way. Each size runs once per --protection, each a
   job of its own (its raw TCP measured in that job): ``mac``, the default (every message and
   piece of bytes authenticated: AES-GMAC, the `cryptography` package being installed);
   ``hmac``, as without that package (HMAC-SHA256: the job's ``PYTHONPATH`` starts with a
   folder whose ``cryptography`` cannot be imported); ``encrypted``
   (``PYSHMCKPT_REPLICA_ENCRYPT=1``: AES-256-GCM).

2. Training slowdown (``training``): the demo's GPT (pyshmckpt.cli.demo.gpt) with AdamW on both
   ranks, data parallel (one all_reduce of the flattened gradients a step), OMP_NUM_THREADS=1,
   --steps steps a run; a memory-only save (``persist=False``) every N steps (--every), the
   previous save's ``result()`` awaited before the next save and at the end, with
   ``Checkpointer(replicate=False)`` ("memory") and ``replicate=True`` ("replicated"), and
   without checkpoints; each Checkpointer is made and its writer started before the clock
   starts. A run's time is the slower rank's; slowdown = median run / median run without
   checkpoints - 1. Runs rotate as in 1.

3. Restore on a replaced node (``restore``): continuing the job of 1 (``--max-restarts 1``),
   both ranks save the state persisted (on disk, held in memory and replicated) and wait; node
   1 is then lost and replaced (``nodes[1].fail(); nodes[1].up()``: its processes killed, its
   /dev/shm empty) and its torchrun started again. Node 0's rank fails in a barrier and exits as
   a crashed trainer; its writer holds its own checkpoint and node 1's replica while node 0's
   torchrun agent lives, and that agent restarts the rank (which is why node 0's torchrun is
   the same throughout: the replica outlives the trainer only while its launcher does). The
   two new ranks then time ``pyshmckpt.load(root)`` ("peer": node 1's rank fetches its
   checkpoint from node 0's memory, which the worker checks in the restore log: "from the
   memory of rank") and ``pyshmckpt.load(root, source="disk")`` ("disk"), alternating, each
   call over a gloo group made beforehand (and the modules load imports on first use imported
   before the first). Before each call the page cache is dropped (``sync;
   echo 3 > /proc/sys/vm/drop_caches``, which needs root; --no-drop-caches or no permission:
   the disk figures are warm, and say so) and each rank reads the files it maps (torch's
   libraries) again, so that only the checkpoint's pages are cold, as on a replacement node
   that has imported torch. Figures: node 1's rank's load time; goal: disk / peer >= 3x.

Both nodes share this machine's cores: the copies through the bridge, the writers' checksums
and the training of both ranks compete for them, so the slowdowns are what a machine without
spare cores sees. Checkpoint roots live in --dir (a temporary directory under it, which both
nodes see; use a real disk, not tmpfs), removed at the end unless --keep (which also keeps the
jobs' logs). Segments carry a prefix of this run's own: every job must leave none on either node
(checked once it ended) nor on this machine. Memory: each node holds up to about 6.5x the
largest size at once (state, two slots, the replica held and the one arriving, raw buffers):
about 13 GiB in all for 1 GiB. The defaults are meant to take under 10 minutes on 2 idle cores
with one protection; each further protection adds a throughput job per size (about a minute for
both sizes at the default repeats).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
import simnodes  # noqa: E402  (tests/simnodes.py: stdlib only)

WORKER = HERE / "replication_worker.py"
MIB = 1 << 20
GIB = 1 << 30
MEASUREMENTS = ("throughput", "training", "restore")
PROTECTIONS = ("mac", "hmac", "encrypted")  # see the module
RUN_TIMEOUT = 900  # seconds one torchrun launch may take
SAVED_TIMEOUT = 600  # seconds until both ranks' persisted save is done
FREED_TIMEOUT = 60  # seconds the writers may take to free their memory once a job ended
RENDEZVOUS_PORT = 29400  # per job: + the job's number (ports are per simulated node)


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(MiB|GiB)", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"a size like 256MiB or 1GiB, not {text!r}")
    return int(float(match[1]) * (MIB if match[2] == "MiB" else GIB))


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


class Run:
    """The two nodes, the environment of every job, and the jobs started so far."""

    def __init__(self, nodes: list[simnodes.Node], work: Path, prefix: str) -> None:
        self.nodes = nodes
        self.work = work
        self.prefix = prefix
        self.jobs = 0
        self.env = dict(os.environ, PYSHMCKPT_SEGMENT_PREFIX=prefix, OMP_NUM_THREADS="1")
        path = [str(REPO), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env["PYTHONPATH"] = os.pathsep.join(path)
        # Restarted ranks must not read the first attempt's gloo addresses from the agent's
        # store (pytorch/pytorch#135712: refused connections or a hang in init).
        self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

    def torchrun(
        self, node: simnodes.Node, mode: str, out: Path, restarts: int, log: IO[str]
    ) -> subprocess.Popen[Any]:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--max-restarts", str(restarts), "--monitor-interval",
            "0.1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"{self.nodes[0].address}:{RENDEZVOUS_PORT + self.jobs}", "--rdzv-id",
            f"replbench-{os.getpid()}-{self.jobs}", str(WORKER), mode, str(out),
        ]  # fmt: skip
        env = self.env | {"BENCH_NODE": str(node.index)}
        return node.start(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def ours(self, node: simnodes.Node) -> list[str]:
        return [n for n in node.shm_files() if n.startswith(self.prefix + "-")]

    def host_ours(self) -> list[str]:
        return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(self.prefix + "-")]

    def job(
        self,
        mode: str,
        params: dict[str, Any],
        restore: bool = False,
        env: dict[str, str] | None = None,
    ) -> Path:
        """One job on both nodes (see the module), with `env` added to its environment,
        checked to have left no segment of ours anywhere; its output folder (the ranks'
        results and logs)."""
        self.jobs += 1
        saved_env = self.env
        self.env = self.env | (env or {})
        try:
            return self._job(mode, params, restore)
        finally:
            self.env = saved_env

    def _job(self, mode: str, params: dict[str, Any], restore: bool) -> Path:
        out = self.work / f"job{self.jobs}-{mode}"
        out.mkdir()
        (out / "params.json").write_text(json.dumps(params))
        logs = [(out / f"node{n.index}.log").open("w") for n in self.nodes]
        replaced = None
        try:
            launched = [
                self.torchrun(n, mode, out, int(restore), log)
                for n, log in zip(self.nodes, logs, strict=True)
            ]
            if restore:
                saved = [out / f"saved-node{n.index}.json" for n in self.nodes]
                wait_until(
                    lambda: all(p.exists() for p in saved)
                    or any(p.poll() is not None for p in launched),
                    SAVED_TIMEOUT, "both ranks' persisted save", out,
                )  # fmt: skip
                if not all(p.exists() for p in saved):
                    fail(f"a launch ended before both ranks saved: {codes(launched)}", out)
                self.nodes[1].fail()  # its processes killed, its /dev/shm gone with them
                self.nodes[1].up()  # a replacement: same address, empty memory
                if self.ours(self.nodes[1]):
                    fail(f"a replaced node 1 holds {self.ours(self.nodes[1])}", out)
                replaced = (out / "node1-replacement.log").open("w")
                launched[1] = self.torchrun(self.nodes[1], mode, out, 1, replaced)
            for process in launched:
                try:
                    process.wait(RUN_TIMEOUT)
                except subprocess.TimeoutExpired:
                    fail(f"a torchrun ran past {RUN_TIMEOUT} s", out)
            if any(p.returncode != 0 for p in launched):
                fail(f"a torchrun failed: {codes(launched)}", out)
        finally:
            for log in [*logs, replaced]:
                if log is not None:
                    log.close()
        wait_until(
            lambda: not any(self.ours(n) for n in self.nodes), FREED_TIMEOUT,
            "every writer to free its memory once the job ended", out,
            lambda: f"left: {[self.ours(n) for n in self.nodes]}",
        )  # fmt: skip
        if self.host_ours():
            fail(f"this machine's /dev/shm holds {self.host_ours()}", out)
        return out


def codes(processes: list[subprocess.Popen[Any]]) -> list[int | None]:
    return [p.poll() for p in processes]


def logs_of(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-6000:]}" for p in sorted(out.glob("*.log")))


def fail(message: str, out: Path) -> None:
    raise SystemExit(f"{message}\n{logs_of(out)}\n{message}")


def wait_until(
    ready: Callable[[], bool],
    timeout: float,
    what: str,
    out: Path,
    detail: Callable[[], str] = lambda: "",
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            fail(f"timed out after {timeout:g} s waiting for {what} {detail()}", out)
        time.sleep(0.1)


# -- the three measurements --------------------------------------------------------------------


def protection_env(run: Run, protection: str) -> dict[str, str]:
    """The environment a job adds for `protection` (see the module)."""
    if protection == "encrypted":
        return {"PYSHMCKPT_REPLICA_ENCRYPT": "1"}
    if protection == "hmac":  # as if `cryptography` were not installed
        hidden = run.work / "no-cryptography" / "cryptography"
        hidden.mkdir(parents=True, exist_ok=True)
        (hidden / "__init__.py").write_text(
            'raise ImportError("hidden by bench/replication.py --protection hmac")\n'
        )
        return {"PYTHONPATH": os.pathsep.join([str(hidden.parent), run.env["PYTHONPATH"]])}
    return {"PYSHMCKPT_REPLICA_ENCRYPT": "0"}


def throughput_of(out: Path, exact: int) -> dict[str, Any]:
    """The throughput figures of a job: per mode, times and GiB/s; and the suite it used."""
    done = json.loads((out / "throughput.json").read_text())
    times: dict[str, list[float]] = {}
    stages: dict[str, list[float]] = {}
    for row in done["rows"]:  # a mode's time: its slower direction's
        times.setdefault(row["mode"], []).append(max(row["seconds"].values()))
        stages.setdefault(row["mode"], []).extend(row["stage_seconds"].values())
    modes = {
        mode: {
            "times_s": t, "median_s": statistics.median(t),
            "gib_per_s": exact / GIB / statistics.median(t),
            "stage_median_s": statistics.median(stages[mode]) if stages.get(mode) else None,
        }
        for mode, t in times.items()
    }  # fmt: skip
    return {"suite": done.get("suite"), "modes": modes}


def replication_size(run: Run, args: argparse.Namespace, nbytes: int) -> dict[str, Any]:
    """Throughput (for each protection) and with "restore", the restore (in the first
    protection's job) for one size."""
    exact = nbytes // 4 // args.tensors * 4 * args.tensors
    case: dict[str, Any] = {"size": nbytes, "bytes": exact, "throughput": {}}
    restore = "restore" in args.measure
    protections = args.protection if "throughput" in args.measure else args.protection[:1]
    for i, protection in enumerate(protections):
        params = {
            "root": str(Path(tempfile.mkdtemp(prefix="root-", dir=run.work))), "bytes": nbytes,
            "tensors": args.tensors, "repeats": args.repeats, "restore": restore and i == 0,
            "prefix": run.prefix, "hold_timeout": 600, "drop_caches": args.drop_caches,
            "throughput": "throughput" in args.measure,
        }  # fmt: skip
        out = run.job(
            "replicate", params, restore=params["restore"], env=protection_env(run, protection)
        )
        if params["throughput"]:
            case["throughput"][protection] = throughput_of(out, exact)
        if params["restore"]:
            case["restore"] = restore_of(out)
        shutil.rmtree(params["root"], ignore_errors=True)
    return case


def restore_of(out: Path) -> dict[str, Any]:
    """The restore figures of a job."""
    loads = json.loads((out / "restore-node1.json").read_text())["rows"]
    node0 = json.loads((out / "restore-node0.json").read_text())["rows"]
    return {
        source: {
            "node1_times_s": [r["seconds"] for r in loads if r["source"] == source],
            "node1_median_s": statistics.median(
                r["seconds"] for r in loads if r["source"] == source
            ),
            "node1_from": sorted({r["from"] for r in loads if r["source"] == source}),
            "node0_median_s": statistics.median(
                r["seconds"] for r in node0 if r["source"] == source
            ),
            "node0_from": sorted({r["from"] for r in node0 if r["source"] == source}),
        }
        for source in ("peer", "disk")
    }  # fmt: skip


def training(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    params = {
        "root": str(Path(tempfile.mkdtemp(prefix="train-", dir=run.work))), "steps": args.steps,
        "every": args.every, "repeats": args.repeats, "width": args.width,
        "layers": args.layers, "vocab": args.vocab, "seq_len": args.seq_len,
        "batch_size": args.batch_size,
    }  # fmt: skip
    out = run.job("train", params)
    runs = json.loads((out / "training.json").read_text())["runs"]
    medians: dict[str, float] = {}
    for way, every in {(r["way"], r["every"]) for r in runs}:
        key = "none" if way == "none" else f"{way}@{every}"
        medians[key] = statistics.median(
            r["seconds"] for r in runs if (r["way"], r["every"]) == (way, every)
        )
    base = medians["none"]
    slowdown = {k: v / base - 1 for k, v in medians.items() if k != "none"}
    shutil.rmtree(params["root"], ignore_errors=True)
    return {"runs": runs, "medians_s": medians, "slowdown": slowdown}


# -- the report --------------------------------------------------------------------------------


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    cases = results["cases"]
    if "throughput" in args.measure:
        print(
            f"\nreplication throughput, 2 nodes x 1 rank, {args.tensors} tensors, median of "
            f"{args.repeats} (GiB/s; raw TCP: sendfile from /dev/shm to a faulted-in buffer, "
            "in the same job)"
        )
        print(f"{'MiB':>6s} {'protection':12s} {'suite':12s} {'direction':10s} {'raw TCP':>8s} "
              f"{'replica':>8s} {'replica/raw':>11s} {'goal':>6s} {'save() ms':>9s}")  # fmt: skip
        for case in cases:
            for protection, done in case["throughput"].items():
                t = done["modes"]
                for way in ("one way", "both ways"):
                    raw, replica = t[f"raw {way}"], t[f"replica {way}"]
                    ratio = replica["gib_per_s"] / raw["gib_per_s"]
                    key = f"{protection}_replica_over_raw_{way.replace(' ', '_')}"
                    case.setdefault("ratios", {})[key] = ratio
                    goal = ">=0.8" if way == "one way" else ""
                    print(
                        f"{case['bytes'] / MIB:6.0f} {protection:12s} {done['suite'] or '?':12s} "
                        f"{way:10s} {raw['gib_per_s']:8.2f} {replica['gib_per_s']:8.2f} "
                        f"{ratio:11.2f} {goal:>6s} {replica['stage_median_s'] * 1e3:9.1f}"
                    )
    if "restore" in args.measure:
        cold = "cold" if results["cold_measured"] else "WARM (page cache not dropped)"
        print(
            f"\nrestore on a replaced node 1 (its rank's pyshmckpt.load), median of "
            f"{args.repeats} (s; disk: page cache {cold})"
        )
        print(f"{'MiB':>6s} {'from peer':>9s} {'GiB/s':>6s} {'from disk':>9s} {'GiB/s':>6s} "
              f"{'disk/peer':>9s} {'goal':>5s} {'node 0: memory / disk':>22s}")  # fmt: skip
        for case in cases:
            r, size = case["restore"], case["bytes"] / GIB
            peer, disk = r["peer"]["node1_median_s"], r["disk"]["node1_median_s"]
            case.setdefault("ratios", {})["disk_over_peer"] = disk / peer
            print(
                f"{case['bytes'] / MIB:6.0f} {peer:9.3f} {size / peer:6.2f} {disk:9.3f} "
                f"{size / disk:6.2f} {disk / peer:9.2f} {'>=3':>5s} "
                f"{r['peer']['node0_median_s']:10.3f} / {r['disk']['node0_median_s']:.3f}"
            )
    if "training" in args.measure:
        t = results["training"]
        print(
            f"\ntraining slowdown, 2 nodes x 1 rank, GPT width {args.width}, {args.layers} "
            f"layers, vocab {args.vocab}, {args.steps} steps, a memory-only save every N steps, "
            f"median of {args.repeats}; no checkpoints: {t['medians_s']['none']:.2f} s"
        )
        print(f"{'every N':>8s} {'memory':>8s} {'replicated':>11s} {'added by replication':>21s}")
        for n in args.every:
            memory, replicated = t["slowdown"][f"memory@{n}"], t["slowdown"][f"replicated@{n}"]
            print(
                f"{n:8d} {memory * 100:7.1f}% {replicated * 100:10.1f}% "
                f"{(replicated - memory) * 100:20.1f}%"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[256 * MIB, GIB])
    parser.add_argument("--tensors", type=int, default=64, help="tensors of the flat state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--measure", nargs="+", choices=MEASUREMENTS, default=list(MEASUREMENTS),
        help="which measurements (default: all three)",
    )  # fmt: skip
    parser.add_argument(
        "--protection", nargs="+", choices=PROTECTIONS, default=list(PROTECTIONS),
        help="how replicas are protected in the throughput jobs (default: all three)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=30, help="training steps a run")
    parser.add_argument("--every", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--no-drop-caches", dest="drop_caches", action="store_false",
        help="restore from a warm page cache (as when dropping it is not permitted)",
    )  # fmt: skip
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (the jobs' logs and results)"
    )  # fmt: skip
    args = parser.parse_args()
    reason = simnodes.unavailable()
    if reason is not None:
        print(f"bench/replication.py skipped: {reason}")
        return
    if args.drop_caches and not can_drop_caches():
        print("the page cache cannot be dropped (needs root): disk restores are measured warm")
        args.drop_caches = False
    largest = max(args.sizes) if {"throughput", "restore"} & set(args.measure) else 0
    # Per node: two slots (1.25x each), the replica held and the one arriving, a raw source;
    # a tmpfs size is a limit, not memory taken.
    shm_mib = math.ceil(6 * largest / MIB) + 2048
    prefix = f"pyshmckpt-replbench{os.getpid()}"
    work = Path(tempfile.mkdtemp(prefix="replication-bench-", dir=args.dir))
    results: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpu_count": os.cpu_count(), "cold_measured": args.drop_caches, "cases": [],
        "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
    }  # fmt: skip
    began = time.monotonic()
    try:
        with simnodes.simulated_nodes(2, shm_size=f"{shm_mib}m") as nodes:
            run = Run(nodes, work, prefix)
            if {"throughput", "restore"} & set(args.measure):
                for nbytes in args.sizes:
                    results["cases"].append(replication_size(run, args, nbytes))
                    print(f"{nbytes / MIB:.0f} MiB done ({time.monotonic() - began:.0f} s)",
                          file=sys.stderr, flush=True)  # fmt: skip
            if "training" in args.measure:
                results["training"] = training(run, args)
                print(f"training done ({time.monotonic() - began:.0f} s)", file=sys.stderr)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    results["seconds"] = time.monotonic() - began
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    report(results, args)
    print(f"\n{results['seconds']:.0f} s in all; load average before {results['loadavg_before']}"
          f", after {results['loadavg_after']}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
