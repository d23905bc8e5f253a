"""Restore after a crash: from the memory tier against the same checkpoint read from disk.

    python bench/memory_restore.py                              # 256 MiB and 1 GiB, gpt + flat
    python bench/memory_restore.py --sizes 64MiB --repeats 3    # quick check
    python bench/memory_restore.py --dir /mnt/nvme --json out.json

For each size and state, a trainer process builds the state, saves it with a Checkpointer
(persisted, so it is on disk too) and is SIGKILLed once the save is durable: its writer process
keeps that checkpoint in shared memory (the memory tier's hold). Then every repeat starts fresh
Python processes that import torch and pyshmckpt and time one call each, from before to after
(interpreter start and imports excluded):

* ``memory``      ``pyshmckpt.load(root, source="memory")``: the held copy (CRC32C checked),
                  copied into memory of the new process's own
* ``mapped``      ``pyshmckpt.load(root, source="memory", mmap=True)``: the held copy as it is,
                  the tensors copy-on-write views of it (every CRC32C checked, nothing copied)
* ``copy``        no pyshmckpt: the held segment's bytes copied once into a fresh tensor
                  (``torch.empty`` + ``copy_``), the floor a restore that copies cannot beat
* ``disk-cold``   ``pyshmckpt.load(root, source="disk")`` after ``sync`` and
                  ``echo 3 > /proc/sys/vm/drop_caches`` (needs root; "not measured" without)
* ``disk-warm``   the same with the checkpoint's files read once just before (page cache warm)

Each returns a new state dict with every CRC32C checked (load's defaults). The three run in a
rotating order in every repeat; each figure is the median over --repeats. States: ``gpt``
(bench/load_speed.py's GPT with its AdamW state after one step, 8 layers, the width chosen to
come near the size) and ``flat`` (the size in --tensors equal float32 tensors). Goals:
a restore from memory >= 5x faster than a cold disk and no slower than ``copy``. The checkpoints live in --dir (a
temporary directory under it; use a real disk, not tmpfs); the holds are freed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
GIB = 1 << 30
SOURCES = ("memory", "mapped", "copy", "disk-cold", "disk-warm")
TIMEOUT = 900  # seconds one trainer or loader process may take
GPT_LAYERS = 8
GPT_VOCAB, GPT_CTX = 16384, 512


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(MiB|GiB)", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"a size like 256MiB or 1GiB, not {text!r}")
    return int(float(match[1]) * (MIB if match[2] == "MiB" else GIB))


def gpt_width(nbytes: int) -> int:
    """A width (a multiple of 48: 6 heads) that makes the GPT and its AdamW state about `nbytes`:
    three float32 copies (weights and two moments) of vocab*d + ctx*d + layers*(12 d^2 + 13 d)."""
    best, error = 48, float("inf")
    for d in range(48, 8192, 48):
        params = (GPT_VOCAB + GPT_CTX + 2) * d + GPT_LAYERS * (12 * d * d + 13 * d)
        if abs(12 * params - nbytes) < error:
            best, error = d, abs(12 * params - nbytes)
    return best


# -- the trainer: builds the state, saves it, dies ---------------------------------------------


def trainer(kind: str, nbytes: int, tensors: int, root: str) -> None:
    import torch
    from load_speed import GPT, gpt_state, make_flat, nbytes_of, tensors_of

    import pyshmckpt

    if kind == "gpt":
        torch.manual_seed(0)
        model = GPT(vocab=GPT_VOCAB, d=gpt_width(nbytes), layers=GPT_LAYERS, ctx=GPT_CTX)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randint(0, GPT_VOCAB, (2, 32))).float().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state: Any = gpt_state(model, optimizer)
    else:
        state = make_flat(nbytes, tensors)
    checkpointer = pyshmckpt.Checkpointer(root)
    checkpointer.save(state, name="ckpt").result(timeout=TIMEOUT)
    print(json.dumps({"bytes": nbytes_of(state), "tensors": len(tensors_of(state))}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the writer holds the checkpoint for a new trainer


# -- a loader: one timed load in a fresh process ----------------------------------------------


def loader(source: str, root: str) -> None:
    import torch  # noqa: F401  (imported before the clock starts, as by any trainer)
    from load_speed import nbytes_of, tensors_of

    import pyshmckpt
    from pyshmckpt.storage import reader  # noqa: F401
    from pyshmckpt.tiers import loading, records, restore  # noqa: F401

    if source == "disk-cold":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    if source == "copy":
        import mmap

        found = records.find(root, 0)
        if found is None:
            raise SystemExit(f"no checkpoint held in memory for {root}")
        segment = found["segment"]
        with (Path("/dev/shm") / segment["name"]).open("rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        held = torch.frombuffer(mapped, dtype=torch.uint8)
        started = time.perf_counter()
        copied = torch.empty_like(held).copy_(held)
        seconds = time.perf_counter() - started
        print(json.dumps({"seconds": seconds, "copied": copied.numel()}))
        return
    started = time.perf_counter()
    if source == "mapped":
        state = pyshmckpt.load(root, source="memory", mmap=True)
    else:
        state = pyshmckpt.load(root, source=source.split("-")[0])
    seconds = time.perf_counter() - started
    print(
        json.dumps(
            {"seconds": seconds, "bytes": nbytes_of(state), "tensors": len(tensors_of(state))}
        )
    )


# -- the driver ---------------------------------------------------------------------------------


def child(env: dict[str, str], *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def read_files(directory: Path) -> None:
    """Read every file under `directory` once: its pages are then in the page cache."""
    for path in directory.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(16 * MIB):
                    pass


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def free_holds(prefix: str) -> None:
    """Free every checkpoint this benchmark holds in memory (its writers then exit)."""
    from pyshmckpt.tiers import records

    for path, record in records.holds(prefix):
        records.release(path, record)


def measure(
    kind: str, nbytes: int, args: argparse.Namespace, env: dict[str, str], directory: Path
) -> dict[str, Any]:
    from pyshmckpt.tiers import records

    root = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=directory))
    try:
        built = child(env, "--trainer", kind, str(nbytes), str(args.tensors), str(root))
        deadline = time.monotonic() + 60
        while records.find(root, 0) is None:  # the writer publishes it once it notices
            if time.monotonic() > deadline:
                raise SystemExit(f"no checkpoint held in memory for {root}")
            time.sleep(0.05)
        sources = [s for s in SOURCES if s != "disk-cold" or can_drop_caches()]
        times: dict[str, list[float]] = {s: [] for s in sources}
        for repeat in range(args.repeats):
            shift = repeat % len(sources)
            for source in sources[shift:] + sources[:shift]:
                if source == "disk-warm":
                    read_files(root / "ckpt")
                got = child(env, "--loader", source, str(root))
                if source == "copy":
                    if got["copied"] < built["bytes"]:
                        raise SystemExit(f"copy copied {got}, the trainer saved {built}")
                elif (got["bytes"], got["tensors"]) != (built["bytes"], built["tensors"]):
                    raise SystemExit(f"{source} restored {got}, the trainer saved {built}")
                times[source].append(got["seconds"])
        return {"bytes": built["bytes"], "tensors": built["tensors"], "times_s": times,
                "medians_s": {s: statistics.median(t) for s, t in times.items()}}  # fmt: skip
    finally:
        free_holds(env["PYSHMCKPT_SEGMENT_PREFIX"])
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        kind, nbytes, tensors, root = sys.argv[2:6]
        trainer(kind, int(nbytes), int(tensors), root)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--loader":
        loader(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[256 * MIB, GIB])
    parser.add_argument("--states", nargs="+", default=["gpt", "flat"], choices=("gpt", "flat"))
    parser.add_argument("--tensors", type=int, default=8192, help="tensors of the flat state")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    prefix = f"pyshmckpt-restorebench{os.getpid()}"
    env = dict(os.environ, PYSHMCKPT_SEGMENT_PREFIX=prefix, PYSHMCKPT_HOLD_TIMEOUT="7200")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    os.environ["PYSHMCKPT_SEGMENT_PREFIX"] = prefix  # this process finds and frees the holds
    directory = Path(tempfile.mkdtemp(prefix="memory-restore-", dir=args.dir))
    results: dict[str, Any] = {
        "repeats": args.repeats, "cpu_count": os.cpu_count(), "cold_measured": can_drop_caches(),
        "loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "cases": [],
    }  # fmt: skip
    if not can_drop_caches():
        print("disk-cold: not measured (dropping the page cache needs root)")
    try:
        for nbytes in args.sizes:
            for kind in args.states:
                case = {
                    "state": kind,
                    "size": nbytes,
                    **measure(kind, nbytes, args, env, directory),
                }
                results["cases"].append(case)
                print(f"{kind} {nbytes / MIB:.0f} MiB done", file=sys.stderr, flush=True)
    finally:
        free_holds(prefix)
        shutil.rmtree(directory, ignore_errors=True)
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    print(f"\nrestore in a fresh process, median of {args.repeats} (ms; GiB/s)")
    print(f"{'state':6s} {'MiB':>6s} {'tensors':>7s} " + " ".join(f"{s:>18s}" for s in SOURCES)
          + "  cold/memory (>=5)  cold/mapped (>=5)  copy/mapped (>=1)")  # fmt: skip
    for case in results["cases"]:
        med, size = case["medians_s"], case["bytes"]
        cells = [
            f"{med[s] * 1e3:9.1f} {size / GIB / med[s]:6.2f}/s"
            if s in med
            else f"{'not measured':>18s}"
            for s in SOURCES
        ]
        cold = med["disk-cold"] / med["memory"] if "disk-cold" in med else float("nan")
        cold_mapped = med["disk-cold"] / med["mapped"] if "disk-cold" in med else float("nan")
        floor = med["copy"] / med["mapped"]
        case["ratios"] = {"cold_over_memory": cold, "cold_over_mapped": cold_mapped,
                          "copy_over_mapped": floor}  # fmt: skip
        print(f"{case['state']:6s} {size / MIB:6.0f} {case['tensors']:7d} " + " ".join(cells)
              + f"  {cold:17.2f}  {cold_mapped:17.2f}  {floor:17.2f}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
