"""The rounds of bench/soak.py whose fault hits the buddy of a replicating rank.

Two simulated nodes (tests/simnodes.py: network namespaces with an address and a /dev/shm of their
own; root only), brought up once for the whole soak and reused by every such round; a round
starts one trainer per node (world size 2, gloo, env://), each with a
``Checkpointer(root, replicate=True)`` on a root both nodes see (a directory of the host), short
timeouts (`STALL`, `REPLICA_TIMEOUT`, `HEARTBEAT_TIMEOUT`) and ~1 MiB states. Both ranks make
two fault-free saves (persisted, memory-only), then save in lockstep, alternating persisted and
memory-only saves, while the fault hits node 1 (rank 0's buddy):

- buddy-killed: node 1 fails (`Node.fail`: every process SIGKILLed, its /dev/shm gone) at a
  random moment of the first 2 s; rank 0 saves on for `FAULT_FOR` seconds, then once more;
- buddy-stopped: every process of node 1 is SIGSTOPped at a random moment of the first 2 s for
  `FAULT_FOR` seconds (longer than the stall, replica and heartbeat timeouts) while rank 0 saves
  on, then SIGCONTed; both ranks then save up to the same step (`AFTER_FAULT`): rank 1 fails
  through the steps it missed and the last persisted ones commit again;
- buddy-flooded: a process on each node keeps `IDLE` silent and `TRICKLING` byte-a-second
  connections open to the other node's replica port, reopening each one the writer drops,
  while both ranks make `FLOODED_SAVES` saves (longer than the listener's handshake deadline).

Rank 0 then makes a last, memory-only save and dies (``os._exit``) as a trainer does, so its
writer holds that checkpoint; rank 1 closes normally once rank 0 is done. What is counted (the
keys of soak.py's totals):

- every save's outcome from the trainers' journals: a persisted save of rank 0 whose buddy is
  killed or stopped fails with `CommitError` ("failed and reported"); a memory-only save must
  resolve (with a `ReplicationWarning` when the copy could not be made: "replication warnings"),
  else "memory-only saves failed"; a rank-0 writer replaced, or a save failing with
  `WriteStalledError` or `WriterDiedError`, is "writer killed for replication"; in a flooded
  round any error or `ReplicationWarning` of either rank is "flooded saves hurt"; a save that
  returned and is neither committed nor reported failed is lost, as in soak.py;
- every visible checkpoint of the round is verified and both ranks' files compared with what
  was saved ("torn checkpoints" otherwise);
- rank 0's newest (memory-only) checkpoint is loaded from memory by a plain process on node 0
  (``pyshmckpt.load(root, source="memory")``, no torch.distributed) and compared with what was
  saved: "restored from memory", else "lost checkpoints";
- then rank 0's writer is sent SIGTERM (which ends its hold); a process of the round alive past
  its bound is a hang; a file of ours left in either node's /dev/shm (a failed node's went with
  it) or the host's is a leaked segment. Both nodes are then restarted for the next round.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import simnodes  # noqa: E402  (tests/simnodes.py: stdlib only)

from flood import FLOOD  # noqa: E402  (tests/flood.py: stdlib only)

FAULTS = ("buddy-killed", "buddy-stopped", "buddy-flooded")
STALL = 10.0  # seconds: the writers' stall timeout
REPLICA_TIMEOUT = 4.0  # seconds: PYSHMCKPT_REPLICA_TIMEOUT
HEARTBEAT_TIMEOUT = 4.0  # seconds: PYSHMCKPT_HEARTBEAT_TIMEOUT (a gone rank fails a commit)
HOLD_TIMEOUT = 120.0  # seconds: a bound only, the round ends the hold itself (SIGTERM)
ORPHAN_WAIT = 60.0  # seconds the memory load waits for rank 0's writer to publish its hold
FAULT_FOR = 12.0  # seconds node 1 stays killed or stopped while rank 0 saves on
# Saves rank 0 makes once the fault is over, its last included: a stopped buddy saves again
# (and catches up) meanwhile; a killed one does not come back.
AFTER_FAULT = {"buddy-killed": 2, "buddy-stopped": 4}
SAVE_TIMEOUT = 60.0  # seconds a trainer waits for one save's Future
# Under SAVE_TIMEOUT: a save whose commit or write runs out of time fails with its own error.
BARRIER_TIMEOUT, WRITE_TIMEOUT = 30.0, 50.0
READY_BOUND = 150.0  # seconds both trainers may take to start and make their first saves
ROUND_BOUND = 180.0  # seconds a trainer may take from "go" to its exit
EXIT_BOUND = 30.0  # seconds writers may take to exit once their trainer ended (or SIGTERM)
LOAD_BOUND = 120.0  # seconds the memory load on node 0 may take
IDLE, TRICKLING = 200, 50  # flooding connections to each replica port
# Saves of each rank under the flood, a pause after each: the flood outlasts the listener's
# 10 s handshake deadline, so the writers drop and the flooders reopen connections meanwhile.
FLOODED_SAVES, FLOOD_PAUSE = 8, 1.5
PORT_BASE = 30000  # + the round number: the rendezvous port on node 0 (fresh each round)

WORKER = textwrap.dedent(
    """
    # One rank of a buddy round (bench/soak_buddy.py): ROOT JOURNAL CONTROL FAULT ROUND.
    import datetime, json, logging, os, sys, time, traceback, warnings
    from pathlib import Path

    import torch
    import torch.distributed as dist

    import pyshmckpt
    from soak_buddy import (
        BARRIER_TIMEOUT, FLOOD_PAUSE, FLOODED_SAVES, HOLD_TIMEOUT, ROUND_BOUND, SAVE_TIMEOUT,
        STALL, WRITE_TIMEOUT, state,
    )

    root, journal_path, control = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    fault, round_no = sys.argv[4], int(sys.argv[5])
    rank = int(os.environ["RANK"])
    journal = open(journal_path, "a")
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )  # the writer's warnings reach this log too


    def note(**fields):
        journal.write(json.dumps({"rank": rank, "time": time.time(), **fields}) + "\\n")
        journal.flush()


    def wait_for(path, bound):
        deadline = time.monotonic() + bound
        while not path.exists():
            if time.monotonic() > deadline:
                note(event="gave up waiting", file=path.name)
                return False
            time.sleep(0.05)
        return True


    def stop_step():
        # The driver writes "over" (atomically) with the step both ranks save up to.
        try:
            return int((control / "over").read_text())
        except (OSError, ValueError):
            return None


    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    config = pyshmckpt.CheckpointProcessConfig(
        write_timeout_secs=WRITE_TIMEOUT, subprocess_shutdown_timeout_secs=2, max_restarts=10,
    )
    checkpointer = pyshmckpt.Checkpointer(
        root, config=config, capacity_bytes=2 << 20, replicate=True, stall_timeout=STALL,
        hold_timeout=HOLD_TIMEOUT, barrier_timeout=BARRIER_TIMEOUT,
    )
    address, port = checkpointer._replica.listen
    note(event="writer", pid=checkpointer.writer_pid, address=address, port=port)
    next_step = round_no * 100


    def save(phase, persist=None):
        # Both ranks save the same steps under the same names, even steps persisted: a
        # persisted save commits once both ranks wrote their part, which keeps them in step
        # without a collective (a rank that fell behind fails through the steps it missed).
        global next_step
        step, next_step = next_step, next_step + 1
        persist = step % 2 == 0 if persist is None else persist
        name = f"r{round_no:04d}-s{step}"
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                future = checkpointer.save(state(step, rank), name=name, persist=persist)
            except Exception as exc:  # noqa: BLE001 - counted by the driver
                note(event="refused", name=name, step=step, error=repr(exc))
                return
            note(event="staged", name=name, step=step, persist=persist, phase=phase,
                 writer=checkpointer.writer_pid)
            error = None
            try:
                future.result(timeout=SAVE_TIMEOUT)
            except TimeoutError:
                if not future.done():
                    note(event="timeout", name=name)
                    return
                error = future.exception()
            except Exception as exc:  # noqa: BLE001 - counted by the driver
                error = exc
        note(
            event="done", name=name, ok=error is None,
            error=None if error is None else f"{type(error).__name__}: {error}",
            error_type=None if error is None else type(error).__name__,
            warnings=[f"{w.category.__name__}: {w.message}" for w in caught],
            seconds=time.monotonic() - started, writer=checkpointer.writer_pid,
        )


    try:
        save("warm-up")
        save("warm-up")
        note(event="ready")
        if wait_for(control / "go", ROUND_BOUND):
            if fault == "buddy-flooded":
                for _ in range(FLOODED_SAVES):
                    save("fault")
                    time.sleep(FLOOD_PAUSE)
            else:
                deadline, stop = time.monotonic() + ROUND_BOUND / 2, None
                while time.monotonic() < deadline and (stop is None or next_step < stop):
                    save("fault")
                    stop = stop_step() if stop is None else stop
        (control / f"fault-done-rank{rank}").touch()
        if rank == 0:
            save("last", persist=False)
            (control / "rank0-done").touch()
            note(event="exit")
            os._exit(0)  # as a trainer that dies: its writer holds the newest checkpoint
        wait_for(control / "rank0-done", ROUND_BOUND)
        checkpointer.close()
        note(event="closed")
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # without tearing down the process group: rank 0 is gone
    """
)

LOAD = textwrap.dedent(
    """
    # Load a root's checkpoint held in memory for a rank, without torch.distributed: ROOT RANK.
    import json, sys

    import pyshmckpt
    from soak_buddy import digest

    state = pyshmckpt.load(sys.argv[1], source="memory", rank=int(sys.argv[2]))
    print(json.dumps({"step": int(state["step"]), "digest": digest(state)}))
    """
)


# Failures that mean the writer was killed or replaced (not a save that failed by itself).
WRITER_KILLED = ("WriteStalledError", "WriterDiedError")


def state(step: int, rank: int) -> dict[str, Any]:
    """What rank `rank` saves at `step` (~1 MiB), the same in the trainer and the checks."""
    import torch

    g = torch.Generator().manual_seed(step * 2 + rank)
    return {
        "w": torch.randn(256, 1024, generator=g),
        "b": torch.arange(64) * step + rank,
        "step": step,
        "rank": rank,
    }


def digest(state_dict: dict[str, Any]) -> str:
    """A hash of a flat state dict's keys, tensors (dtype, shape, bytes) and other values."""
    import torch

    h = hashlib.sha256()
    for key in sorted(state_dict):
        value = state_dict[key]
        h.update(key.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().contiguous()
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.view(torch.uint8).reshape(-1).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def unavailable() -> str | None:
    """Why buddy rounds cannot run here, or None."""
    return simnodes.unavailable()


class Nodes:
    """Two simulated nodes for the whole soak (see the module), restarted between rounds."""

    def __init__(self, work: Path, prefix: str) -> None:
        self.work = work
        self.prefix = prefix
        self.worker = work / "buddy_worker.py"
        self.loader = work / "buddy_load.py"
        self.flooder = work / "buddy_flood.py"
        self.nodes: list[simnodes.Node] = []

    @contextlib.contextmanager
    def up(self) -> Iterator[Nodes]:
        self.worker.write_text(WORKER)
        self.loader.write_text(LOAD)
        self.flooder.write_text(FLOOD)
        with simnodes.simulated_nodes(2, shm_size="256m") as nodes:
            self.nodes = nodes
            try:
                yield self
            finally:
                self.nodes = []

    def ours(self, node: simnodes.Node) -> list[str]:
        return [n for n in node.shm_files() if n.startswith(self.prefix + "-")]

    def stray(self, node: simnodes.Node) -> list[str]:
        """Live processes of the node other than its keeper: "pid command"."""
        keeper = node._keeper.pid if node._keeper is not None else None
        found = []
        for pid in node.processes():
            if pid != keeper and alive(pid):
                with contextlib.suppress(OSError):
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    found.append(f"{pid} {command.decode(errors='replace')[:200]}")
        return found

    def env(self, round_no: int) -> dict[str, str]:
        path = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
        return dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(path),
            PYSHMCKPT_SEGMENT_PREFIX=self.prefix,
            PYSHMCKPT_REPLICA_TIMEOUT=str(REPLICA_TIMEOUT),
            PYSHMCKPT_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT),
            PYSHMCKPT_HOLD_TIMEOUT=str(HOLD_TIMEOUT),
            PYSHMCKPT_ORPHAN_WAIT=str(ORPHAN_WAIT),
            OMP_NUM_THREADS="1",
            MASTER_ADDR=self.nodes[0].address,
            MASTER_PORT=str(PORT_BASE + round_no % 20000),
            WORLD_SIZE="2",
            LOCAL_RANK="0",
        )


def read_journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
            events.append(json.loads(line))
    return events


def host_ours(prefix: str) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix + "-")]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in ("Z", "X")


def signal_all(pids: list[int], signo: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signo)


def read_line(stream: IO[str], timeout: float) -> str:
    """One line of a pipe, or "" when none comes within `timeout` seconds."""
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else ""


def stop_flooding(flooders: list[subprocess.Popen[str]]) -> int:
    """End the flooders (bounded); how many connections the writers dropped and they reopened."""
    reopened = 0
    for flooder in flooders:
        assert flooder.stdin is not None
        assert flooder.stdout is not None
        if not flooder.stdin.closed:
            with contextlib.suppress(OSError):
                flooder.stdin.close()
        said = read_line(flooder.stdout, 10).split() if not flooder.stdout.closed else []
        if said[:1] == ["reopened"]:
            reopened += int(said[1])
        if flooder.poll() is None:
            flooder.kill()
        flooder.wait(30)
        flooder.stdout.close()
    flooders.clear()
    return reopened


def run_round(
    round_no: int, fault: str, nodes: Nodes, base_root: Path, seed: float
) -> Counter[str]:
    """One buddy round (see the module); the counts of what went wrong and of what happened."""
    counts: Counter[str] = Counter()
    began = time.monotonic()
    for node in nodes.nodes:
        if not node.is_up:
            node.up()
    root = base_root / f"r{round_no:04d}"
    shutil.rmtree(root, ignore_errors=True)  # a kept --root's earlier soak
    root.mkdir(parents=True)
    # A crash round ("both") leaves this machine's segments for the next start there to collect.
    host_before = set(host_ours(nodes.prefix))
    folder = nodes.work / f"buddy-{round_no:04d}"
    control = folder / "control"
    control.mkdir(parents=True)
    journals = [folder / f"rank{r}.jsonl" for r in range(2)]
    logs = [(folder / f"rank{r}.log").open("w") for r in range(2)]
    env = nodes.env(round_no)
    trainers = [
        node.start(
            [
                sys.executable,
                str(nodes.worker),
                str(root),
                str(journals[r]),
                str(control),
                fault,
                str(round_no),
            ],
            env=env | {"RANK": str(r)},
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            cwd=folder,
        )
        for r, node in enumerate(nodes.nodes)
    ]
    flooders: list[subprocess.Popen[str]] = []
    stopped: list[int] = []
    fault_began = None
    try:
        deadline = time.monotonic() + READY_BOUND
        while not all(any(e["event"] == "ready" for e in read_journal(j)) for j in journals):
            if any(t.poll() is not None for t in trainers) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        ready = all(any(e["event"] == "ready" for e in read_journal(j)) for j in journals)
        if ready and fault == "buddy-flooded":
            ports = [next(e for e in read_journal(j) if e["event"] == "writer") for j in journals]
            for node, target in ((nodes.nodes[1], ports[0]), (nodes.nodes[0], ports[1])):
                flooders.append(
                    node.start(
                        [
                            sys.executable,
                            str(nodes.flooder),
                            target["address"],
                            str(target["port"]),
                            str(IDLE),
                            str(TRICKLING),
                        ],
                        env=env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        cwd=folder,
                    )
                )
            for flooder in flooders:
                assert flooder.stdout is not None
                if read_line(flooder.stdout, 60).strip() != "flooding":
                    counts["flood did not start"] += 1
        if not ready:
            counts["trainer errors"] += 1
            print(f"round {round_no} ({fault}): the ranks were not both ready in time")
            (control / "over").write_text("0")  # whoever still saves stops
        (control / "go").touch()  # also when not ready: whoever waits goes on, and ends
        if flooders:
            done = [control / f"fault-done-rank{r}" for r in range(2)]
            deadline = time.monotonic() + ROUND_BOUND
            while not all(p.exists() for p in done) and time.monotonic() < deadline:
                if any(t.poll() is not None for t in trainers):
                    break
                time.sleep(0.1)
            counts["flooding connections dropped by the writers"] += stop_flooding(flooders)
        if ready and fault != "buddy-flooded":
            fault_began = time.monotonic()
            time.sleep(seed * 2.0)  # a random moment of the lockstep saves
            if fault == "buddy-killed":
                nodes.nodes[1].fail()
            else:
                # A process may be starting one when the first are stopped: look again.
                for _ in range(3):
                    pids = [p for p in nodes.nodes[1].processes() if p not in stopped]
                    signal_all(pids, signal.SIGSTOP)
                    stopped += pids
            time.sleep(FAULT_FOR)
            staged = [e["step"] for e in read_journal(journals[0]) if e["event"] == "staged"]
            over = control / "over.tmp"
            over.write_text(str(max(staged, default=0) + AFTER_FAULT[fault]))
            over.replace(control / "over")
            if stopped:
                signal_all(stopped, signal.SIGCONT)
                stopped = []
        deadline = time.monotonic() + ROUND_BOUND
        for rank, trainer in enumerate(trainers):
            try:
                trainer.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                counts["hangs"] += 1
                print(f"round {round_no} ({fault}): rank {rank}'s trainer is still running")
                trainer.kill()
                trainer.wait(30)
    finally:
        signal_all(stopped, signal.SIGCONT)
        if not (control / "over").exists():
            (control / "over").write_text("0")  # whoever still saves stops
        stop_flooding(flooders)
        for log in logs:
            log.close()

    events = [e for j in journals for e in read_journal(j)]
    for rank, trainer in enumerate(trainers):
        killed = fault == "buddy-killed" and rank == 1
        if trainer.returncode != 0 and not (killed and trainer.returncode == -signal.SIGKILL):
            counts["trainer errors"] += 1
            log = (folder / f"rank{rank}.log").read_text()[-4000:]
            print(f"round {round_no} ({fault}): rank {rank} exited {trainer.returncode}:\n{log}")

    # Rank 0's newest checkpoint, from memory on node 0, by a process without torch.distributed.
    staged0 = [e for e in events if e["rank"] == 0 and e["event"] == "staged"]
    if staged0 and staged0[-1]["phase"] == "last":
        newest = staged0[-1]
        counts.update(memory_check(round_no, fault, nodes, root, newest, env, folder))
    elif trainers[0].returncode == 0:
        counts["trainer errors"] += 1
        print(f"round {round_no} ({fault}): rank 0 made no last save")

    # Rank 0's writer holds its checkpoint until SIGTERM; every writer must then be gone.
    writers = {(e["rank"], e["pid"]) for e in events if e["event"] == "writer"}
    writers |= {(e["rank"], e["writer"]) for e in events if e.get("writer")}
    signal_all([pid for rank, pid in writers if rank == 0], signal.SIGTERM)
    deadline = time.monotonic() + EXIT_BOUND
    while any(alive(pid) for _, pid in writers) and time.monotonic() < deadline:
        time.sleep(0.05)
    for rank, pid in writers:
        if alive(pid):
            counts["hangs"] += 1
            print(f"round {round_no} ({fault}): rank {rank}'s writer {pid} outlived its bound")
            signal_all([pid], signal.SIGKILL)
    for node in nodes.nodes:
        if node.is_up and (stray := nodes.stray(node)):
            counts["hangs"] += len(stray)
            print(f"round {round_no} ({fault}): node {node.index} still runs {stray}")
            signal_all([int(p.split()[0]) for p in stray], signal.SIGKILL)
    left = [Path("/dev/shm", n) for n in set(host_ours(nodes.prefix)) - host_before]
    for node in nodes.nodes:
        if node.is_up and (ours := nodes.ours(node)):
            mine = sorted(pid for rank, pid in writers if rank == node.index)
            print(
                f"round {round_no} ({fault}): node {node.index}'s /dev/shm keeps {ours} once"
                f" every process of the round ended (rank {node.index}'s writers: {mine})"
            )
            counts["leaked segments"] += len(ours)
    counts["leaked segments"] += len(left)
    for p in left:
        p.unlink(missing_ok=True)

    counts.update(count_saves(round_no, fault, root, events))
    for node in nodes.nodes:  # nothing of the round outlives it, and the next finds them up
        node.restart()
    shutil.rmtree(root, ignore_errors=True)
    counts["seconds in buddy rounds"] += round(time.monotonic() - began)
    if fault_began is not None:
        counts["seconds from the fault to the end"] += round(time.monotonic() - fault_began)
    return counts


def memory_check(
    round_no: int,
    fault: str,
    nodes: Nodes,
    root: Path,
    newest: dict[str, Any],
    env: dict[str, str],
    folder: Path,
) -> Counter[str]:
    """Load rank 0's checkpoint held in memory on node 0 and compare it with `newest`."""
    counts: Counter[str] = Counter()
    try:
        done = nodes.nodes[0].run(
            [sys.executable, str(nodes.loader), str(root), "0"],
            timeout=LOAD_BOUND,
            env=env,
            cwd=folder,
        )
    except subprocess.TimeoutExpired:
        counts["hangs"] += 1
        counts["lost checkpoints"] += 1
        print(f"round {round_no} ({fault}): loading from memory took over {LOAD_BOUND:g} s")
        return counts
    got = None
    if done.returncode == 0:
        with contextlib.suppress(json.JSONDecodeError, IndexError):
            got = json.loads(done.stdout.strip().splitlines()[-1])
    expected = digest(state(newest["step"], 0))
    if got is not None and got["step"] == newest["step"] and got["digest"] == expected:
        counts["restored from memory"] += 1
    else:
        counts["lost checkpoints"] += 1
        print(
            f"round {round_no} ({fault}): {newest['name']} is not restorable from node 0's memory"
            f" (got {got}):\n{done.stderr[-3000:]}"
        )
    return counts


def count_saves(
    round_no: int, fault: str, root: Path, events: list[dict[str, Any]]
) -> Counter[str]:
    """Every save of both ranks: what became of it (see the module)."""
    import pyshmckpt

    counts: Counter[str] = Counter()
    named = re.compile(rf"r{round_no:04d}-s\d+")
    visible = {p.name for p in root.iterdir() if named.fullmatch(p.name)}
    others = [p.name for p in root.iterdir() if not named.fullmatch(p.name)]
    if unexpected := [n for n in others if not n.startswith(".") and n != "latest"]:
        print(f"round {round_no} ({fault}): the root also holds {unexpected}")
    for name in sorted(visible):
        step = int(name.rsplit("-s", 1)[1])
        try:
            pyshmckpt.verify(root / name)
            ok = all(
                digest(pyshmckpt.load(root / name, rank=r)) == digest(state(step, r))
                for r in range(2)
            )
        except pyshmckpt.PyshmckptError as exc:
            print(f"round {round_no} ({fault}): {name}: {exc}")
            ok = False
        counts["torn checkpoints" if not ok else "committed"] += 1

    done = {(e["rank"], e["name"]): e for e in events if e["event"] == "done"}
    timed_out = {(e["rank"], e["name"]) for e in events if e["event"] == "timeout"}
    flooded = fault == "buddy-flooded"
    for rank in range(2):
        staged = [e for e in events if e["rank"] == rank and e["event"] == "staged"]
        counts["refused saves"] += sum(
            1 for e in events if e["rank"] == rank and e["event"] == "refused"
        )
        answered = [done[(rank, e["name"])] for e in staged if (rank, e["name"]) in done]
        first = [e["pid"] for e in events if e["rank"] == rank and e["event"] == "writer"]
        pids = list(dict.fromkeys(first + [e["writer"] for e in staged + answered]))
        killed_saves = 0
        for e in staged:
            key, name = (rank, e["name"]), e["name"]
            outcome = done.get(key)
            what = f"round {round_no} ({fault}): rank {rank}'s {name}"
            if outcome is not None and (flooded or rank == 0):
                warned = [w for w in outcome["warnings"] if w.startswith("ReplicationWarning")]
                counts["replication warnings"] += len(warned)
                if flooded and (warned or not outcome["ok"]):
                    counts["flooded saves hurt"] += 1
                    print(f"{what} under the flood: {outcome['error']} {warned}")
            if outcome is not None and not outcome["ok"] and outcome["error_type"] in WRITER_KILLED:
                if rank == 0 or flooded:
                    killed_saves += 1
                    print(f"{what}: {outcome['error']}")
                else:
                    counts["stopped buddy's own saves stalled"] += 1
            if key in timed_out:
                counts["hangs"] += 1
                print(f"{what} did not resolve within {SAVE_TIMEOUT:g} s")
                continue
            if not e["persist"]:
                if outcome is None:
                    if fault == "buddy-killed" and rank == 1:
                        counts["dropped with their killed node"] += 1
                    else:
                        counts["lost checkpoints"] += 1
                        print(f"{what} (memory-only) was staged and never resolved")
                elif outcome["ok"]:
                    counts["memory-only saves resolved"] += 1
                elif rank == 0 and outcome["error_type"] not in WRITER_KILLED:
                    counts["memory-only saves failed"] += 1
                    print(f"{what} (memory-only) failed: {outcome['error']}")
                elif rank == 1:
                    counts["failed and reported"] += 1
                continue
            if name in visible:
                if outcome is not None and not outcome["ok"]:
                    counts["committed, yet reported failed"] += 1
                continue
            if outcome is not None and not outcome["ok"]:
                counts["failed and reported"] += 1
                if outcome["error_type"] not in ("CommitError", *WRITER_KILLED):
                    print(f"{what} failed: {outcome['error']}")
            elif outcome is None and fault == "buddy-killed" and rank == 1:
                counts["dropped with their killed node"] += 1
            else:
                counts["lost checkpoints"] += 1
                print(f"{what} was staged and is gone ({outcome})")
        replaced = max(len(pids) - 1, 0)
        if rank == 0 or flooded:
            if replaced or killed_saves:
                print(f"round {round_no} ({fault}): rank {rank}'s writers {pids}")
            counts["writer killed for replication"] += max(replaced, killed_saves)
        elif replaced:
            counts["stopped buddy's writer replaced"] += replaced
    return counts
