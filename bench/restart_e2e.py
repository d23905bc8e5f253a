"""A crash and restart under torchrun, end to end: from rank 1's SIGKILL to the restarted ranks
holding the restored state, with the last checkpoint in memory only against on disk only.

    python bench/restart_e2e.py                           # 256 MiB per rank, 3 repeats
    python bench/restart_e2e.py --mib 64 --repeats 1      # quick check
    python bench/restart_e2e.py --mib 1024 --tensors 8192 --dir /mnt/nvme --json out.json

Each run is one ``torchrun --nproc-per-node 2 --max-restarts 1`` (gloo, CPU) of this script. The
first attempt builds --mib MiB per rank in --tensors float32 tensors and saves it:

* ``memory``  ``Checkpointer(root).save(state, persist=False)``: nothing on disk; the writers
              hold it in shared memory once their trainers die
* ``disk``    ``Checkpointer(root, hold=False).save(state).result()``: durable on disk, nothing
              held (the files were just written: their pages are likely in the page cache)

then both ranks meet in a barrier, rank 1 writes a timestamp and SIGKILLs itself; rank 0 sleeps
until torchrun's agent stops it and starts both ranks again. Each restarted rank writes a
timestamp once ``pyshmckpt.load(root)`` (collective, over a gloo group of its own) has returned
the state (restoring it through a new ``Checkpointer(root)``, which takes the held memory over).
End to end = the later rank's timestamp - the kill's. It includes torchrun's own restart (noticing
the death, stopping rank 0, a new rendezvous, starting two interpreters that import torch and
pyshmckpt), the same for both ways; the parts are printed too, for the later rank: to its
start, its imports, process-group setup, the Checkpointer (with the run id's broadcast) and the
load (with the ranks' agreement), the collectives including any wait for the other rank. Runs
alternate between the ways; figures are medians over --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = ("memory", "disk")
MIB = 1 << 20
TIMEOUT = 600  # seconds one torchrun launch may take
PHASES = ("restart", "imports", "process group", "Checkpointer", "load")


# -- one rank, run by torchrun -------------------------------------------------------------------


def process_start() -> float:
    """When this process started (wall clock, 10 ms resolution): /proc's start ticks count from
    boot, as CLOCK_BOOTTIME does."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since


def worker(way: str, root: Path, out: Path, mib: int, tensors: int) -> None:
    import torch
    import torch.distributed as dist

    import pyshmckpt

    imported = time.time()
    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")  # checkpoint collectives never meet training's
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    grouped = time.time()
    checkpointer = pyshmckpt.Checkpointer(
        root, process_group=group, hold=way == "memory", barrier_timeout=TIMEOUT
    )
    constructed = time.time()
    if attempt == 0:
        numel = mib * MIB // 4 // tensors
        g = torch.Generator().manual_seed(rank)
        state = {f"layers.{i}.weight": torch.rand(numel, generator=g) for i in range(tensors)}
        state["step"] = 7
        if way == "memory":
            checkpointer.save(state, name="last", persist=False)
        else:
            checkpointer.save(state, name="last").result(timeout=TIMEOUT)
        dist.barrier()  # both ranks' saves have returned
        if rank == 1:
            (out / "killed.json").write_text(json.dumps({"at": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(TIMEOUT)  # until the agent stops this rank
        raise SystemExit("rank 0 was not stopped by the agent")
    loaded = pyshmckpt.load(root, process_group=group)
    restored = time.time()
    nbytes = sum(t.nbytes for t in loaded.values() if isinstance(t, torch.Tensor))
    (out / f"restored{rank}.json").write_text(
        json.dumps({
            "started": process_start(), "imported": imported, "grouped": grouped,
            "constructed": constructed, "restored": restored, "step": loaded["step"],
            "bytes": nbytes,
        })
    )  # fmt: skip
    del loaded
    checkpointer.close()
    dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ours(prefix: str) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix + "-")]


def run(way: str, args: argparse.Namespace, directory: Path, prefix: str) -> dict[str, float]:
    """One torchrun launch; returns the end-to-end seconds and the phases."""
    work = Path(tempfile.mkdtemp(prefix=f"{way}-", dir=directory))
    root, out = work / "root", work / "out"
    out.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"restart-{way}",
        __file__, "--worker", way, str(root), str(out), str(args.mib), str(args.tensors),
    ]  # fmt: skip
    env = dict(os.environ, PYSHMCKPT_SEGMENT_PREFIX=prefix)
    # Restarted ranks must not read the first attempt's gloo addresses from the agent's shared
    # store (pytorch/pytorch#135712: refused connections or a hang in init).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        if done.returncode != 0:
            raise SystemExit(f"torchrun {way} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        killed = json.loads((out / "killed.json").read_text())["at"]
        ranks = [json.loads((out / f"restored{r}.json").read_text()) for r in (0, 1)]
        for r in ranks:
            if (
                r["step"] != 7
                or r["bytes"] != args.mib * MIB // 4 // args.tensors * 4 * args.tensors
            ):
                raise SystemExit(f"{way}: restored {r}")
        last = max(ranks, key=lambda r: r["restored"])
        return {
            "end_to_end": last["restored"] - killed,
            "restart": last["started"] - killed,
            "imports": last["imported"] - last["started"],
            "process group": last["grouped"] - last["imported"],
            "Checkpointer": last["constructed"] - last["grouped"],
            "load": last["restored"] - last["constructed"],
        }
    finally:
        deadline = time.monotonic() + 15  # the writers end with the agent
        while ours(prefix) and time.monotonic() < deadline:
            time.sleep(0.1)
        if ours(prefix):
            subprocess.run([sys.executable, "-m", "pyshmckpt", "gc", "--prefix", prefix], env=env)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        way, root, out, mib, tensors = sys.argv[2:7]
        worker(way, Path(root), Path(out), int(mib), int(tensors))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state per rank (default 256)")
    parser.add_argument("--tensors", type=int, default=1024, help="tensors per rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    prefix = f"pyshmckpt-restart{os.getpid()}"
    directory = Path(tempfile.mkdtemp(prefix="restart-e2e-", dir=args.dir))
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    try:
        for repeat in range(args.repeats):
            for way in WAYS[repeat % 2 :] + WAYS[: repeat % 2]:
                runs[way].append(run(way, args, directory, prefix))
                print(f"repeat {repeat} {way:6s} {runs[way][-1]['end_to_end']:.2f} s", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    medians = {
        way: {k: statistics.median(r[k] for r in runs[way]) for k in runs[way][0]} for way in WAYS
    }
    print(f"\nkill to restored state, {args.mib} MiB per rank in {args.tensors} tensors, 2 ranks, "
          f"median of {args.repeats} (s)")  # fmt: skip
    print(f"{'way':8s} {'end to end':>10s} " + " ".join(f"{p:>13s}" for p in PHASES))
    for way in WAYS:
        m = medians[way]
        print(f"{way:8s} {m['end_to_end']:10.2f} " + " ".join(f"{m[p]:13.2f}" for p in PHASES))
    ratio = medians["disk"]["end_to_end"] / medians["memory"]["end_to_end"]
    load_ratio = medians["disk"]["load"] / medians["memory"]["load"]
    print(
        f"disk / memory: {ratio:.2f}x end to end, {load_ratio:.2f}x the load alone "
        "(torchrun's restart is in both)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "runs": runs, "medians": medians,
                                         "ratio_end_to_end": ratio, "ratio_load": load_ratio},
                                        indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
