"""Soak test of the never-lose promise, run on demand (not in CI): rounds of saves, each round
with one random fault, and a count of what went wrong.

    python bench/soak.py --rounds 100 [--busy 3] [--seed 1] [--root DIR] [--faults KIND ...]
                         [--keep]

Each round meets one fault, drawn by a seeded RNG among the kinds available (``--faults``
limits the draw to the kinds named). In the first five, a trainer process saves a few
checkpoints through a `Checkpointer`:

- trainer: the trainer SIGKILLs itself right after a save() returned (its writer must finish
  and commit every save it was handed, and hold the newest in memory: a new process loads it
  from memory and compares it with what was saved, then SIGTERM ends the hold);
- writer: the writer is SIGKILLed mid-run (the saves it held fail and say so; later ones land);
- both: writer and trainer are SIGKILLed (a node crash: what they held is gone, nothing torn);
- disk-full: a save does not fit the disk (it fails with ENOSPC; earlier ones stay intact);
- hung: the writer is stopped (SIGSTOP) mid-write (the stall timeout kills it and fails that save;
  the saves made after that land through a restarted writer).

The other three hit the buddy of a replicating rank (bench/soak_buddy.py, which says how they
are counted): two simulated nodes (tests/simnodes.py), one rank each, ``replicate=True``; both
ranks save persisted and memory-only checkpoints in lockstep while node 1 meets the fault:

- buddy-killed: node 1 fails (every process SIGKILLed, its /dev/shm gone) while rank 0 saves on
  (its persisted saves fail with CommitError, its memory-only saves resolve with a warning);
- buddy-stopped: every process of node 1 is SIGSTOPped for longer than the stall, replica and
  heartbeat timeouts while rank 0 saves on, then SIGCONTed (and catches up);
- buddy-flooded: hundreds of idle and trickling connections to both replica ports while both
  ranks save (every save completes as without them).

Rank 0's writer is never to be replaced for it, and rank 0's newest, memory-only checkpoint must
load from node 0's memory, equal to what was saved.

After each round it counts: torn visible checkpoints (a visible checkpoint that fails
`pyshmckpt.verify` or holds other values than were saved), leaked shared-memory segments and
hold records (this machine's /dev/shm; for buddy rounds the nodes' too), hangs (a trainer,
writer or save still alive or pending past its bound), and lost checkpoints: a save that
returned (staged) and was neither committed nor reported failed, while its writer lived, or a
buddy round's newest memory-only checkpoint not restorable from memory. Also counted as failures:
a writer killed for replication (replaced, or a save failing with WriteStalledError), a memory-only
save that failed, a save hurt by a flood (an error or a ReplicationWarning), and a trainer
round's newest checkpoint not restorable from memory. Goal: all of them 0.

Needs root for the small tmpfs of the disk-full rounds and for simulated nodes (those rounds are
skipped without it, with a line saying so). ``--busy N`` runs N busy loops beside the rounds for
their whole length: a machine as busy as a training node, where every start and every write is
slowed and races show. ``--keep`` keeps the work folder (journals, the buddy ranks' logs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import soak_buddy  # bench/soak_buddy.py: the rounds on simulated nodes

FAULTS = ("trainer", "writer", "both", "disk-full", "hung", *soak_buddy.FAULTS)
SAVES = 3
TRAINER_BOUND = 90.0  # seconds a round's trainer may take
WRITER_BOUND = 30.0  # seconds an orphaned writer may take after its trainer died
HOLD_BOUND = 120.0  # seconds a writer holds after its trainer's death if nobody ends the hold
GOAL = (
    "torn checkpoints", "leaked segments", "hangs", "lost checkpoints",
    "writer killed for replication", "memory-only saves failed", "flooded saves hurt",
    "not restorable from memory",
)  # fmt: skip

TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys, time

    import torch

    import pyshmckpt


    def state(step):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(256, 1024, generator=g), "b": torch.arange(64) * step, "step": step}


    def main():
        root, journal_path, fault, round_no = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
        journal = open(journal_path, "a")

        def note(**fields):
            journal.write(json.dumps(fields) + "\\n")
            journal.flush()

        config = pyshmckpt.CheckpointProcessConfig(
            write_timeout_secs=30, write_stall_timeout_secs=3, subprocess_shutdown_timeout_secs=2,
            max_restarts=10,
        )
        checkpointer = pyshmckpt.Checkpointer(root, config=config, capacity_bytes=2 << 20)
        note(event="writer", pid=checkpointer._process.pid)
        futures = []
        for i in range(3):
            step = round_no * 10 + i
            size = 64 << 20 if (fault == "disk-full" and i == 1) else 0
            sd = state(step)
            if size:
                sd["ballast"] = torch.ones(size // 4)
            name = f"r{round_no:04d}-s{step}"
            try:
                future = checkpointer.save(sd, name=name)
            except pyshmckpt.PyshmckptError as exc:
                note(event="refused", name=name, step=step, error=repr(exc))
                continue
            note(event="staged", name=name, step=step, writer=checkpointer._process.pid)
            future.add_done_callback(
                lambda f, name=name: note(
                    event="done", name=name, ok=f.exception() is None,
                    error=repr(f.exception()) if f.exception() else None,
                )
            )
            futures.append(future)
            writer = checkpointer._process.pid
            if fault == "trainer" and i == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "writer" and i == 1:
                os.kill(writer, signal.SIGKILL)
            if fault == "both" and i == 1:
                os.kill(writer, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hung" and i == 0:
                time.sleep(0.02)
                os.kill(writer, signal.SIGSTOP)
                future.exception(timeout=60)  # the next saves go to a restarted writer
        for future in futures:
            with __import__("contextlib").suppress(Exception):
                future.result(timeout=60)
        checkpointer.close()
        note(event="closed")


    if __name__ == "__main__":
        main()
    """
)


def expected_state(step: int) -> dict[str, object]:
    import torch

    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.arange(64) * step, "step": step}


def same(expected: dict[str, object], loaded: dict[str, object]) -> bool:
    import torch

    if set(loaded) - {"ballast"} != set(expected):
        return False
    for key, value in expected.items():
        got = loaded[key]
        if isinstance(value, torch.Tensor):
            if not (isinstance(got, torch.Tensor) and torch.equal(got, value)):
                return False
        elif got != value:
            return False
    return True


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in ("Z", "X")


@contextlib.contextmanager
def small_disk(base: Path, size: str = "16m"):
    """A tmpfs of `size` (root only); None where it cannot be mounted."""
    mount = base / "small-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
        capture_output=True, check=False,
    )  # fmt: skip
    try:
        yield mount if done.returncode == 0 else None
    finally:
        if done.returncode == 0:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def run_round(round_no: int, fault: str, root: Path, prefix: str, work: Path) -> Counter[str]:
    """One trainer with one fault; returns the counts of what went wrong (and of what happened)."""
    import pyshmckpt

    counts: Counter[str] = Counter()
    journal = work / f"journal-{round_no}.jsonl"
    script = work / "trainer.py"
    env = dict(
        os.environ, PYSHMCKPT_SEGMENT_PREFIX=prefix, PYSHMCKPT_HOLD_TIMEOUT=str(HOLD_BOUND),
        PYSHMCKPT_ORPHAN_WAIT=str(WRITER_BOUND),
    )  # fmt: skip
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(root), str(journal), fault, str(round_no)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=str(work),
    )  # fmt: skip
    try:
        _, err = trainer.communicate(timeout=TRAINER_BOUND)
    except subprocess.TimeoutExpired:
        counts["hangs"] += 1
        trainer.kill()
        _, err = trainer.communicate(timeout=30)
    if trainer.returncode not in (0, -signal.SIGKILL):
        counts["trainer errors"] += 1
        print(f"round {round_no} ({fault}): trainer exited {trainer.returncode}:\n{err}")
    lines = journal.read_text().splitlines() if journal.exists() else []
    events = [json.loads(line) for line in lines]
    writers = {e["pid"] for e in events if e["event"] == "writer"} | {
        e["writer"] for e in events if e["event"] == "staged"
    }
    staged = [e for e in events if e["event"] == "staged"]
    if fault == "trainer" and trainer.returncode == -signal.SIGKILL and staged:
        # Its writer holds the newest checkpoint in memory for a restart: load it as one would,
        # then end the hold as a scheduler ending the job does (SIGTERM).
        counts.update(held_check(round_no, fault, root, staged[-1]["step"], env, work))
        for pid in writers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + WRITER_BOUND
    while any(alive(pid) for pid in writers) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in writers:
        if alive(pid):
            counts["hangs"] += 1
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    left = [p for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix + "-")]
    if fault == "both":
        # A node crash: nobody is left to remove them; the next start collects them (checked
        # after the next round, and at the end).
        counts["left by a crash for the next start"] += len(left)
    else:
        counts["leaked segments"] += len(left)
        for p in left:
            p.unlink(missing_ok=True)

    visible = {p.name for p in root.iterdir() if not p.name.startswith(".") and p.name != "latest"}
    for name in sorted(n for n in visible if n.startswith(f"r{round_no:04d}-")):
        step = int(name.rsplit("-s", 1)[1])
        try:
            pyshmckpt.verify(root / name)
            ok = same(expected_state(step), pyshmckpt.load(root / name))
        except pyshmckpt.PyshmckptError:
            ok = False
        counts["torn checkpoints" if not ok else "committed"] += 1
    done = {e["name"]: e for e in events if e["event"] == "done"}
    writer_killed = fault in ("writer", "both")
    for staged in (e for e in events if e["event"] == "staged"):
        name = staged["name"]
        outcome = done.get(name)
        if name in visible:
            if outcome is not None and not outcome["ok"]:
                # The writer was killed between its commit and its reply: the checkpoint is whole
                # and visible, but the trainer could only report the death.
                counts["committed, yet reported failed"] += 1
            continue
        if outcome is not None and not outcome["ok"]:
            counts["failed and reported"] += 1
        elif fault == "both" or (writer_killed and outcome is None):
            counts["dropped with their killed writer"] += 1
        else:
            counts["lost checkpoints"] += 1
            print(f"round {round_no} ({fault}): {name} was staged and is gone ({outcome})")
    return counts


def held_check(
    round_no: int, fault: str, root: Path, step: int, env: dict[str, str], work: Path
) -> Counter[str]:
    """Load the checkpoint held in memory for `root` in a new process and compare it with the
    state of `step`."""
    counts: Counter[str] = Counter()
    path = [str(Path(__file__).resolve().parent), *filter(None, [env.get("PYTHONPATH")])]
    try:
        done = subprocess.run(
            [sys.executable, str(work / "load.py"), str(root), "0"], capture_output=True,
            text=True, timeout=WRITER_BOUND + 60, cwd=str(work),
            env=env | {"PYTHONPATH": os.pathsep.join(path)},
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        counts["hangs"] += 1
        counts["not restorable from memory"] += 1
        print(f"round {round_no} ({fault}): loading from memory did not end")
        return counts
    got = None
    if done.returncode == 0:
        with contextlib.suppress(json.JSONDecodeError, IndexError):
            got = json.loads(done.stdout.strip().splitlines()[-1])
    if got == {"step": step, "digest": soak_buddy.digest(expected_state(step))}:
        counts["restored from memory"] += 1
    else:
        counts["not restorable from memory"] += 1
        print(f"round {round_no} ({fault}): step {step} from memory: {got}\n{done.stderr[-3000:]}")
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--root", type=Path, help="checkpoint root (default: a temporary dir)")
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the rounds")
    parser.add_argument(
        "--faults", nargs="+", choices=FAULTS, default=list(FAULTS), metavar="FAULT",
        help=f"the fault kinds rounds draw from (default: all of {', '.join(FAULTS)})",
    )  # fmt: skip
    parser.add_argument(
        "--keep", action="store_true", help="keep the work folder (journals, the ranks' logs)"
    )
    args = parser.parse_args()
    # A SIGTERM (a scheduler's, `kill`) unwinds like Ctrl-C: the busy loops, the simulated nodes'
    # namespaces and mounts, and the work folder are cleaned up on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with busy_loops(args.busy):
        return soak(args)


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """`count` processes spinning on a core each while the block runs."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def soak(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    prefix = f"pyshmckpt-soak{os.getpid()}"
    totals: Counter[str] = Counter()
    per_fault: Counter[str] = Counter()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="pyshmckpt-soak-"))
        if args.keep:
            print(f"work folder (kept): {work}")
        else:
            stack.callback(shutil.rmtree, work, ignore_errors=True)
        (work / "trainer.py").write_text(TRAINER)
        (work / "load.py").write_text(soak_buddy.LOAD)
        root = args.root or work / "root"
        root.mkdir(parents=True, exist_ok=True)
        buddy_root = root.with_name(root.name + "-buddy")  # the buddy rounds' roots, one each
        faults = [f for f in FAULTS if f in args.faults]
        disk = stack.enter_context(small_disk(work)) if "disk-full" in faults else None
        if disk is None and "disk-full" in faults:
            print("no tmpfs could be mounted (not root?): disk-full rounds are skipped")
            faults.remove("disk-full")
        nodes = None
        if any(f in soak_buddy.FAULTS for f in faults):
            reason = soak_buddy.unavailable()
            if reason is None:
                nodes = stack.enter_context(soak_buddy.Nodes(work, prefix).up())
            else:
                print(f"no simulated nodes ({reason}): buddy rounds are skipped")
                faults = [f for f in faults if f not in soak_buddy.FAULTS]
        if not faults:
            print("no fault kind left to draw")
            return 1
        for round_no in range(args.rounds):
            fault = rng.choice(faults)
            moment = rng.random()  # when a buddy round's fault hits (drawn for every round)
            per_fault[fault] += 1
            if fault in soak_buddy.FAULTS:
                assert nodes is not None
                counts = soak_buddy.run_round(round_no, fault, nodes, buddy_root, moment)
            else:
                round_root = disk if fault == "disk-full" else root
                assert round_root is not None
                counts = run_round(round_no, fault, round_root, prefix, work)
            totals.update(counts)
            if fault == "disk-full" and disk is not None:  # make room for the next one
                for entry in disk.iterdir():
                    subprocess.run(["rm", "-rf", str(entry)], check=False)
            print(f"round {round_no:3d} {fault:13s} {dict(counts)}", flush=True)
        with contextlib.suppress(OSError):
            buddy_root.rmdir()
        # What the last crash left: the next start collects it (as every round's trainer did).
        from pyshmckpt.shm import collect_stale_segments

        collect_stale_segments(prefix)
        left = [p for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix + "-")]
        totals["leaked segments"] += len(left)
        for p in left:
            p.unlink(missing_ok=True)
    elapsed = time.monotonic() - started
    busy = f", {args.busy} busy loops beside them" if args.busy else ""
    print(f"\n{args.rounds} rounds in {elapsed:.0f} s{busy}; faults: {dict(per_fault)}")
    for key in GOAL:
        print(f"{key}: {totals.get(key, 0)}")
    print("also:", {k: v for k, v in totals.items() if k not in GOAL})
    return 0 if all(totals.get(key, 0) == 0 for key in GOAL) else 1


if __name__ == "__main__":
    sys.exit(main())
