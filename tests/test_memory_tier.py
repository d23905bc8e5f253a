"""The memory tier with real processes: a trainer saves, part of it in shared memory only, and dies;
its writer holds the newest checkpoint for a new trainer (`pyshmckpt.load`, a takeover) until the
hold timeout, ``pyshmckpt gc``, the end of the launcher or SIGTERM, and nobody else can read it.

Trainers are scripts as users write them (no ``__main__`` guard, no teardown: they SIGKILL
themselves). Importing torch takes each a few seconds of CPU, so the scripts the tests read are
started together when the module starts (`Background`), each under a segment prefix of its own
(so that ``gc`` and the checks on ``/dev/shm`` see only its segments); each test then waits for
its script, acts, and checks. The tests that only read a hold, or take it over, share one trainer
that holds a checkpoint for each of them under its own root.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import inspect
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pyshmckpt
from pyshmckpt.cli import main as cli_main
from pyshmckpt.tiers import records

from helpers import SHM, assert_same_tree, child_env, opened, pid_running, visible, wait_until

PREFIX_VARIABLE = "PYSHMCKPT_SEGMENT_PREFIX"
RUN_TIMEOUT = 300  # seconds a background script may take (a few on an idle machine)
EXIT_TIMEOUT = 15  # seconds a writer may take to end a hold and exit
SMALL_SHM_TIMEOUT = 2 * RUN_TIMEOUT + 3 * EXIT_TIMEOUT  # its two trainers and three waits
HOLD_TIMEOUT = 600  # the holds the tests end themselves: a bound should the session die
TEST_TIMEOUT = RUN_TIMEOUT + 120  # the first test waits for the scripts to save
ROOT = os.geteuid() == 0
UNSHARE = shutil.which("unshare")


def make_state(step: int) -> dict[str, Any]:
    """A small training state (about 1 MiB): a tied pair, a view sharing their storage, several
    dtypes, an optimizer-like tree with int keys, and leaves that are not tensors."""
    g = torch.Generator().manual_seed(step)
    embed = torch.randn(512, 512, generator=g)
    return {
        "model": {
            "embed.weight": embed,
            "head.weight": embed,  # tied
            "norm.bias": torch.arange(8, dtype=torch.bfloat16) * step,
        },
        "rows": embed[16:48],  # a view of the embedding's storage
        "optim": {
            "state": {0: {"exp_avg": torch.full((64,), float(step), dtype=torch.float64)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "step": step,
        "tag": f"step {step}",
        "flags": (True, None),
    }


# A trainer: saves step-1 to disk and step-2 in memory only under each root, prints its writers'
# pids, then dies (SIGKILL) or, given a file, creates it and sleeps until a signal ends it.
TRAINER = (
    textwrap.dedent(
        """
        import json, os, signal, sys, time
        from typing import Any

        import torch

        import pyshmckpt

        """
    )
    + textwrap.dedent(inspect.getsource(make_state))
    + textwrap.dedent(
        """
        roots, hold_timeout, then = sys.argv[1].split(os.pathsep), float(sys.argv[2]), sys.argv[3]
        checkpointers = [pyshmckpt.Checkpointer(root, hold_timeout=hold_timeout) for root in roots]
        for ck in checkpointers:
            ck.save(make_state(1), name="step-1").result(timeout=60)
        for ck in checkpointers:
            ck.save(make_state(2), name="step-2", persist=False).result(timeout=60)
        print(json.dumps({"writers": [ck._process.pid for ck in checkpointers]}), flush=True)
        if then == "die":
            os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill: no cleanup of any kind
        open(then, "w").close()
        time.sleep(300)  # until the launcher's signals end it
        """
    )
)

# torchrun's elastic agent in miniature: starts the trainer in a session of its own (writing its
# pid to a file), and outlives it until the test ends it.
AGENT = textwrap.dedent(
    """
    import os, subprocess, sys, time

    os.environ["TORCHELASTIC_RUN_ID"] = "memory-tier-test"
    trainer = subprocess.Popen([sys.executable, *sys.argv[2:]], start_new_session=True)
    with open(sys.argv[1], "w") as f:
        f.write(str(trainer.pid))
    trainer.wait()
    time.sleep(300)
    """
)

# Another user: drops to nobody before importing pyshmckpt, waits for the hold record, then tries
# every file of the prefix in /dev/shm, the record through pyshmckpt, and a load from memory.
# Prints what it got as JSON.
OTHER_USER = textwrap.dedent(
    """
    import ast, importlib, importlib.util, json, os, pathlib, sys, time

    import torch  # while the trainer saves

    # The standard library lives under /root here, which nobody cannot read: import what
    # pyshmckpt imports of it first (found in its source; pyshmckpt itself is not imported).
    package = pathlib.Path(importlib.util.find_spec("pyshmckpt").origin).parent
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] in sys.stdlib_module_names:
                    try:
                        importlib.import_module(name)
                    except ImportError:
                        pass
    assert "pyshmckpt" not in sys.modules
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)

    import pyshmckpt
    from pyshmckpt.tiers import records

    root, prefix = sys.argv[1:3]
    deadline = time.monotonic() + 300
    while not records.record_paths(root, 0):  # the trainer is still saving (names: visible)
        if time.monotonic() > deadline:
            sys.exit("no hold record appeared")
        time.sleep(0.05)
    time.sleep(0.5)  # the writer's pending record is replaced by the whole one
    out = {"uid": os.getuid(), "opened": {}}
    for name in sorted(os.listdir("/dev/shm")):
        if name.startswith(prefix + "-"):
            try:
                with open("/dev/shm/" + name, "rb") as f:
                    out["opened"][name] = f"read {len(f.read())} bytes"
            except OSError as exc:
                out["opened"][name] = type(exc).__name__
    out["record_paths"] = [str(p) for p in records.record_paths(root, 0)]
    out["found"] = records.find(root, 0) is not None
    out["holds"] = len(records.holds())
    try:
        state = pyshmckpt.load(root, source="memory")
        out["load"] = f"loaded step {state.get('step')}"
    except Exception as exc:
        out["load"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
    """
)

# A new trainer whose state does not fit in /dev/shm: takes the held checkpoint over, fails to
# save, loads the held checkpoint, and dies (its writer then holds that checkpoint again).
NEWCOMER = textwrap.dedent(
    """
    import json, os, signal, sys

    import torch

    import pyshmckpt

    root = sys.argv[1]
    ck = pyshmckpt.Checkpointer(root, hold_timeout=float(sys.argv[2]))
    arena = ck._stager.arena  # None unless it took the held checkpoint over
    out = {"writer": ck._process.pid, "first_slot": arena.slots[0].name if arena else None}
    try:
        ck.save({"w": torch.ones(3 << 20)}, name="big").result(timeout=60)  # 12 MiB
        out["save"] = "saved"
    except pyshmckpt.PyshmckptError as exc:
        out["save"] = type(exc).__name__
        out["errno"] = getattr(exc, "errno", None)
        out["message"] = str(exc)
    state = ck.load(source="memory")
    out["step"] = state["step"]
    out["tied"] = state["model"]["head.weight"] is state["model"]["embed.weight"]
    out["files"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(out), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)

# Runs in a mount namespace of its own: mounts a small tmpfs over /dev/shm, runs a trainer that
# leaves a checkpoint held, then the newcomer, then ends the hold with SIGTERM; prints what it saw
# as one JSON line (or why it cannot mount). Every wait is bounded; its writers never outlive it.
SMALL_SHM = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time

    trainer, newcomer, root, size = sys.argv[1:5]
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", "/dev/shm"],
        capture_output=True, text=True, timeout=30,
    )
    if mounted.returncode != 0:
        print(json.dumps({"skip": mounted.stderr.strip()}), flush=True)
        sys.exit(0)
    out, writers = {}, []

    def files():
        return sorted(os.listdir("/dev/shm"))

    def run(*args):
        done = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=%(timeout)d
        )
        if done.returncode != -signal.SIGKILL:
            raise SystemExit(f"{args[0]} exited with {done.returncode}:\\n{done.stderr}")
        return json.loads(done.stdout.splitlines()[-1])

    def record():
        deadline = time.monotonic() + %(exit_timeout)d
        while time.monotonic() < deadline:
            for name in files():
                if "-held-" in name and not name.endswith((".tmp", ".claimed", ".released")):
                    with open("/dev/shm/" + name) as f:
                        found = json.load(f)
                    if not found.get("pending"):  # its writer has finished the trainer's saves
                        return found
            time.sleep(0.05)
        raise SystemExit("no hold record appeared")

    try:
        writers += run(trainer, root, "%(hold)d", "die")["writers"]
        out["first"] = record()
        out["files_held"] = files()
        out["newcomer"] = run(newcomer, root, "%(hold)d")
        writers.append(out["newcomer"]["writer"])
        out["second"] = record()
        out["files_held_again"] = files()
        os.kill(out["second"]["holder"][0], signal.SIGTERM)  # a scheduler ending the job
        held = {out["second"]["segment"]["name"]} | {n for n in files() if "-held-" in n}
        deadline = time.monotonic() + %(exit_timeout)d
        while held & set(files()) and time.monotonic() < deadline:
            time.sleep(0.05)
        out["files_after_sigterm"] = files()
    finally:
        for pid in writers:  # nothing may outlive this namespace's tmpfs
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(json.dumps(out), flush=True)
    """
) % {"timeout": RUN_TIMEOUT, "exit_timeout": EXIT_TIMEOUT, "hold": HOLD_TIMEOUT}


# -- the scripts, started in the background ------------------------------------------------------


@dataclasses.dataclass
class Job:
    """A script started when the module starts, for the tests that read it (`result`)."""

    label: str
    prefix: str  # of its segments and hold records
    directory: Path
    roots: dict[str, Path]
    process: subprocess.Popen[str]
    deadline: float
    done: subprocess.CompletedProcess[str] | None = None

    def result(self) -> subprocess.CompletedProcess[str]:
        """Wait for the script to end (at most until its deadline) and return its output."""
        if self.done is None:
            try:
                out, err = self.process.communicate(
                    timeout=max(1.0, self.deadline - time.monotonic())
                )
            except subprocess.TimeoutExpired:
                self.stop()
                out, err = "", f"the {self.label} script ran past its deadline and was killed"
            self.done = subprocess.CompletedProcess(
                self.process.args, self.process.returncode, out, err
            )
        return self.done

    def died(self) -> tuple[list[int], str]:
        """Wait for a trainer that kills itself; returns its writers' pids and its error output
        (where a writer logs that it holds a checkpoint, before its output goes to /dev/null)."""
        done = self.result()
        assert done.returncode == -signal.SIGKILL, (
            f"the {self.label} trainer exited with {done.returncode}:\n{done.stderr}"
        )
        return json.loads(done.stdout.splitlines()[-1])["writers"], done.stderr

    def settle(self) -> None:
        """Wait until the script made every segment it makes in this /dev/shm."""
        if self.label == "launcher":  # its trainer lives on until the test ends it
            with contextlib.suppress(AssertionError):
                wait_until(
                    lambda: self.roots["saved"].exists() or self.process.poll() is not None,
                    max(0.0, self.deadline - time.monotonic()), "the trainer to save", poll=0.05,
                )  # fmt: skip
        elif self.label in ("shared", "timeout", "gc"):
            self.result()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=EXIT_TIMEOUT)
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


def script(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(source)
    return path


class Background:
    """The module's background scripts, started on first use; each under a prefix of its own."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._base = os.environ[PREFIX_VARIABLE]  # the session's
        self.jobs: dict[str, Job] = {}
        self._public: Path | None = None

    def __getitem__(self, label: str) -> Job:
        if label not in self.jobs:
            self.jobs[label] = self._start(label)
        return self.jobs[label]

    def _start(self, label: str) -> Job:
        directory = self._factory.mktemp(label)
        prefix = f"{self._base}-{label}"
        env = child_env() | {PREFIX_VARIABLE: prefix}
        python = sys.executable
        trainer = str(script(directory, "trainer.py", TRAINER))
        roots = {"root": directory / "ckpt"}
        root = str(roots["root"])
        if label == "shared":  # one root per test that reads or takes over a hold
            names = ("read", "takeover", "corrupt", "mapped-first", "taken-first")
            roots = {name: directory / name for name in names}
            # Under a directory others may enter: only the hold's own modes keep them out.
            self._public = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
            self._public.chmod(0o755)
            roots["other-user"] = self._public / "other-user"
            args = [
                python,
                trainer,
                os.pathsep.join(map(str, roots.values())),
                str(HOLD_TIMEOUT),
                "die",
            ]
        elif label == "timeout":
            args = [python, trainer, root, "1", "die"]
        elif label == "gc":
            args = [python, trainer, root, str(HOLD_TIMEOUT), "die"]
        elif label == "launcher":
            agent = str(script(directory, "agent.py", AGENT))
            roots["pid"], roots["saved"] = directory / "trainer.pid", directory / "saved"
            args = [
                python,
                agent,
                str(roots["pid"]),
                trainer,
                root,
                str(HOLD_TIMEOUT),
                str(roots["saved"]),
            ]
        elif label == "other-user":
            shared = self["shared"]
            roots = {"root": shared.roots["other-user"]}
            prefix, env = (
                shared.prefix,
                env | {PREFIX_VARIABLE: shared.prefix, "HOME": str(directory)},
            )
            args = [
                python,
                str(script(directory, "other_user.py", OTHER_USER)),
                str(roots["root"]),
                prefix,
            ]
        elif label == "small-shm":
            newcomer = str(script(directory, "newcomer.py", NEWCOMER))
            driver = str(script(directory, "small_shm.py", SMALL_SHM))
            unshare = [str(UNSHARE), "--mount", "--propagation", "private"]
            args = [*unshare, python, driver, trainer, newcomer, root, "8m"]
        else:
            raise KeyError(label)
        process = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=directory
        )
        timeout = SMALL_SHM_TIMEOUT if label == "small-shm" else RUN_TIMEOUT
        return Job(label, prefix, directory, roots, process, time.monotonic() + timeout)

    def close(self) -> None:
        """Stop what still runs and free every hold the scripts left."""
        for job in self.jobs.values():
            if job.label == "launcher" and job.roots["pid"].exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.killpg(int(job.roots["pid"].read_text()), signal.SIGKILL)
            job.stop()
        for prefix in {job.prefix for job in self.jobs.values()}:
            end_holds(prefix)
        if self._public is not None:
            shutil.rmtree(self._public, ignore_errors=True)


# The fixture of each script: its name, and the script's label.
JOB_FIXTURES = {
    "shared_job": "shared",
    "timeout_job": "timeout",
    "gc_job": "gc",
    "launcher_job": "launcher",
    "other_user_job": "other-user",
    "small_shm_job": "small-shm",
}


@pytest.fixture(scope="module")
def background(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Background]:
    """The module's scripts. Outside pytest-xdist, those the selected tests of this module use
    start here, all at once, and this waits until those that make segments in this /dev/shm made
    them all (each test's leak check then counts them as there before the test). Under xdist
    (which runs only some of them here, beside another worker) each starts when first used."""
    jobs = Background(tmp_path_factory)
    try:
        if not hasattr(request.config, "workerinput"):
            for item in request.session.items:
                if getattr(item, "module", None) is not request.module or skipped(item):
                    continue
                for name in getattr(item, "fixturenames", ()):
                    if name in JOB_FIXTURES:
                        jobs[JOB_FIXTURES[name]]  # noqa: B018 -- starts it
            for job in list(jobs.jobs.values()):
                job.settle()
        yield jobs
    finally:
        jobs.close()


def skipped(item: pytest.Item) -> bool:
    """Whether a skipif mark of `item` with a plain condition skips it."""
    return any(mark.args and mark.args[0] is True for mark in item.iter_markers(name="skipif"))


def job_fixture(label: str) -> Any:
    """A module fixture: the script `label`, started (if not yet) and settled before the test."""

    @pytest.fixture(scope="module")
    def fixture(background: Background) -> Job:
        job = background[label]
        job.settle()
        return job

    fixture.__doc__ = f"The {label} script, once it made its segments."
    return fixture


shared_job = job_fixture("shared")
timeout_job = job_fixture("timeout")
gc_job = job_fixture("gc")
launcher_job = job_fixture("launcher")
other_user_job = job_fixture("other-user")
small_shm_job = job_fixture("small-shm")


# -- helpers ------------------------------------------------------------------------------------


def record_path_of(root: Path, prefix: str | None = None) -> Path:
    """The one hold record of `root` (rank 0) in /dev/shm (the prefix from the environment)."""
    paths = records.record_paths(root, 0, prefix=prefix)
    assert len(paths) == 1, paths
    return paths[0]


def record_of(root: Path) -> dict[str, Any]:
    """The hold record of `root` (rank 0), read as a file (the prefix from the environment)."""
    return json.loads(record_path_of(root).read_bytes())


def ours(prefix: str) -> set[str]:
    """Names in /dev/shm under `prefix`: segments and hold records."""
    return {p.name for p in SHM.iterdir() if p.name.startswith(prefix + "-")}


def end_holds(prefix: str, pids: tuple[int, ...] = ()) -> None:
    """Free every hold under `prefix` and end its holders and the writers `pids` (SIGKILL after a
    grace period): the cleanup of a test that may have failed half-way."""
    pids = list(pids)
    for path, record in records.holds(prefix):
        if records.holder_alive(path):
            pids.append(int(record["holder"][0]))
        records.release(path, record)
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not any(pid_running(pid) for pid in pids), 3, "the writers to exit")
    for pid in pids:
        if pid_running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def group_gone(pgid: int) -> bool:
    """Whether no process (a zombie included) is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@contextlib.contextmanager
def holds_ended(job: Job, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Look holds up under `job`'s prefix here; whatever happens, end them afterwards."""
    monkeypatch.setenv(PREFIX_VARIABLE, job.prefix)
    try:
        yield
    finally:
        end_holds(job.prefix)


def entry_to_flip(record: dict[str, Any]) -> tuple[str, int]:
    """(entry name, position in the segment) of a byte in the middle of the record's largest
    tensor entry, read from the record's safetensors header."""
    raw = base64.b64decode(record["header"])
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    name, info = max(
        header.items(), key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0]
    )
    begin, end = info["data_offsets"]
    return name, int(record["segment"]["offset"]) + (begin + end) // 2


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_checkpoint_saved_in_memory_only_outlives_its_trainer(shared_job, monkeypatch, capsys):
    writers, log = shared_job.died()
    assert log.count("holding checkpoint step-2 (rank 0") == len(shared_job.roots), log
    monkeypatch.setenv(PREFIX_VARIABLE, shared_job.prefix)
    root = shared_job.roots["read"]
    record = record_of(root)
    assert record["name"] == "step-2"
    assert record["persisted"] is False
    assert record["holder"][0] in writers
    assert pid_running(record["holder"][0])
    # The holder gave the trainer's other slot back: the held segment is all it maps.
    maps = Path(f"/proc/{record['holder'][0]}/maps").read_text()
    mapped = {
        line.split("/dev/shm/")[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line
    }
    assert mapped == {record["segment"]["name"]}, mapped

    loaded = pyshmckpt.load(root)  # in another process than the trainer's: this one
    assert_same_tree(make_state(2), loaded)
    model = loaded["model"]
    assert model["head.weight"] is model["embed.weight"]  # still tied
    storage = model["embed.weight"].untyped_storage().data_ptr()
    assert loaded["rows"].untyped_storage().data_ptr() == storage
    loaded["rows"][0, 0] = 123.0  # and still a view of it
    assert model["embed.weight"][16, 0] == 123.0

    assert visible(root) == ["step-1"]  # step-2 never reached the disk
    assert not (root / "step-2").exists()
    assert_same_tree(make_state(1), pyshmckpt.load(root, source="disk"))
    assert_same_tree(make_state(2), pyshmckpt.load(root, source="memory"))

    assert cli_main(["inspect", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "on disk    step-1" in lines
    in_memory = [line for line in lines if line.startswith("in memory  step-2  rank 0 ")]
    assert len(in_memory) == 1, lines
    assert in_memory[0].endswith(f"held by pid {record['holder'][0]} (alive), not on disk")


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_new_trainer_takes_the_held_checkpoint_over_as_its_first_slot(shared_job, monkeypatch):
    shared_job.died()
    monkeypatch.setenv(PREFIX_VARIABLE, shared_job.prefix)
    root = shared_job.roots["takeover"]
    record_path = record_path_of(root)
    record = record_of(root)
    segment = SHM / record["segment"]["name"]
    inode = segment.stat().st_ino
    writer = record["holder"][0]
    before = ours(shared_job.prefix)

    with opened(root) as ck:
        assert ck._stager.arena.slots[0].name == segment.name  # no new segment, no copy
        assert segment.stat().st_ino == inode
        assert not list(SHM.glob(record_path.name + "*"))  # claimed: no record, no leftover
        wait_until(lambda: not pid_running(writer), EXIT_TIMEOUT, "the old writer to exit")
        assert_same_tree(make_state(2), ck.load())
        assert_same_tree(make_state(2), pyshmckpt.load(root, source="memory"))

        future = ck.save(make_state(3), name="step-3")
        assert future.result(timeout=60) == root / "step-3"
    assert visible(root) == ["step-1", "step-3"]
    assert ours(shared_job.prefix) == before - {segment.name, record_path.name}
    assert_same_tree(make_state(3), pyshmckpt.load(root))


def mapping_of(tensor: torch.Tensor) -> str:
    """The file (or "" for anonymous memory) whose mapping holds `tensor`'s bytes."""
    address = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 else ""
    raise AssertionError(f"{address:#x} is in no mapping")


@pytest.mark.timeout(TEST_TIMEOUT)
def test_tensors_restored_as_maps_of_the_held_checkpoint_never_change(shared_job, monkeypatch):
    """load(mmap=True) from memory: the tensors are copy-on-write views of the held segment (no
    copy), and a trainer started after it never takes that segment over, so its saves never
    show through them."""
    shared_job.died()
    monkeypatch.setenv(PREFIX_VARIABLE, shared_job.prefix)
    root = shared_job.roots["mapped-first"]
    segment = record_of(root)["segment"]["name"]
    state = pyshmckpt.load(root, source="memory", mmap=True)
    assert_same_tree(make_state(2), state)
    assert mapping_of(state["model"]["embed.weight"]) == str(SHM / segment)  # zero-copy
    with opened(root) as ck:
        for step in (3, 4, 5):  # with two slots, the third save reuses the first's
            ck.save(make_state(step), name=f"step-{step}", persist=False).result(timeout=60)
        assert segment not in [slot.name for slot in ck._stager.arena.slots]  # not taken over
    assert_same_tree(make_state(2), state)
    state["model"]["embed.weight"].add_(1.0)  # private to this process: the held copy stays
    assert_same_tree(make_state(2), pyshmckpt.load(root, source="memory"))


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_mapped_restore_of_a_segment_taken_over_is_a_copy(shared_job, monkeypatch):
    """The other order: a trainer took the held segment over (and will write it at its second
    save), so load(mmap=True) copies what it restores from it."""
    shared_job.died()
    monkeypatch.setenv(PREFIX_VARIABLE, shared_job.prefix)
    root = shared_job.roots["taken-first"]
    segment = record_of(root)["segment"]["name"]
    with opened(root) as ck:
        assert ck._stager.arena.slots[0].name == segment  # taken over
        state = pyshmckpt.load(root, source="memory", mmap=True)
        assert mapping_of(state["model"]["embed.weight"]) != str(SHM / segment)  # copied
        for step in (3, 4, 5):
            ck.save(make_state(step), name=f"step-{step}", persist=False).result(timeout=60)
    assert_same_tree(make_state(2), state)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_the_hold_ends_at_its_timeout(timeout_job, monkeypatch):
    job = timeout_job
    with holds_ended(job, monkeypatch):
        writers, log = job.died()
        assert "holding checkpoint step-2 (rank 0" in log, log  # logged once its record is out
        assert "for up to 1 s" in log, log
        wait_until(lambda: not ours(job.prefix), EXIT_TIMEOUT, "the record and segment to go")
        wait_until(lambda: not pid_running(writers[0]), EXIT_TIMEOUT, "the writer to exit")
        assert_same_tree(make_state(1), pyshmckpt.load(job.roots["root"]))  # from disk now


@pytest.mark.timeout(TEST_TIMEOUT)
def test_gc_frees_a_held_checkpoint(gc_job, monkeypatch):
    job = gc_job
    root = job.roots["root"]
    with holds_ended(job, monkeypatch):
        writers, _ = job.died()
        record = record_of(root)
        assert record["holder"][0] == writers[0]
        assert ours(job.prefix) == {record_path_of(root).name, record["segment"]["name"]}

        done = subprocess.run(
            [sys.executable, "-m", "pyshmckpt", "gc"], cwd=root.parent,  # not the checkout's
            capture_output=True, text=True, env=child_env(), timeout=RUN_TIMEOUT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        freed = (
            f"freed        checkpoint step-2 (rank 0 of {root.resolve()}) held in memory by pid "
            f"{writers[0]}"
        )
        assert freed in done.stdout.splitlines(), done.stdout
        assert not ours(job.prefix)
        wait_until(lambda: not pid_running(writers[0]), EXIT_TIMEOUT, "the writer to exit")
        assert_same_tree(make_state(1), pyshmckpt.load(root))


@pytest.mark.timeout(TEST_TIMEOUT)
def test_the_hold_ends_with_the_launcher_not_with_signals_to_the_trainers_group(
    launcher_job, monkeypatch
):
    job = launcher_job
    agent, root = job.process, job.roots["root"]
    with holds_ended(job, monkeypatch):
        wait_until(job.roots["saved"].exists, RUN_TIMEOUT, "the trainer to save", poll=0.05)
        trainer = int(job.roots["pid"].read_text())
        assert os.getsid(trainer) == trainer  # a session of its own, as under torchrun
        # torchrun stopping its workers: SIGTERM to each worker's process group, then SIGKILL.
        os.killpg(trainer, signal.SIGTERM)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer, signal.SIGKILL)
        wait_until(
            lambda: records.find(root, 0) is not None,
            EXIT_TIMEOUT,
            "the writer to hold the checkpoint",
        )
        record_path = record_path_of(root)
        record = record_of(root)
        writer = record["holder"][0]
        assert record["agent"][0] == agent.pid
        assert os.getsid(writer) != trainer
        assert os.getpgid(writer) != trainer
        # Once the agent reaped the trainer, its group is empty: the writer was never in it.
        wait_until(lambda: group_gone(trainer), EXIT_TIMEOUT, "the trainer's group to empty")
        time.sleep(1)  # five of the writer's polls: the launcher lives, so the hold goes on
        assert pid_running(writer)
        assert record_of(root) == record
        assert ours(job.prefix) == {record_path.name, record["segment"]["name"]}

        agent.kill()  # the launcher is gone: the job is over
        agent.wait(timeout=EXIT_TIMEOUT)
        wait_until(lambda: not ours(job.prefix), EXIT_TIMEOUT, "the writer to free the checkpoint")
        wait_until(lambda: not pid_running(writer), EXIT_TIMEOUT, "the writer to exit")


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_corrupt_memory_copy_falls_back_to_disk(shared_job, monkeypatch):
    shared_job.died()
    monkeypatch.setenv(PREFIX_VARIABLE, shared_job.prefix)
    root = shared_job.roots["corrupt"]
    record = record_of(root)
    entry, position = entry_to_flip(record)
    with (SHM / record["segment"]["name"]).open("r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ 0x5A]))

    with pytest.warns(pyshmckpt.MemoryTierWarning) as warned:
        loaded = pyshmckpt.load(root)
    assert_same_tree(make_state(1), loaded)  # the newest on disk
    assert len(warned) == 1
    message = str(warned[0].message)
    assert message.startswith("rank 0: "), message
    assert "checksum mismatch" in message, message
    assert entry in message, message

    with warnings.catch_warnings():  # whether it warns as well is not the point here
        warnings.simplefilter("ignore", pyshmckpt.MemoryTierWarning)
        with pytest.raises(pyshmckpt.CheckpointCorruptError, match="checksum mismatch"):
            pyshmckpt.load(root, source="memory")


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.skipif(not ROOT, reason="needs root, to run a child as another user (nobody)")
def test_another_user_cannot_read_a_held_checkpoint(shared_job, other_user_job, monkeypatch):
    child = other_user_job
    shared_job.died()
    monkeypatch.setenv(PREFIX_VARIABLE, shared_job.prefix)
    root = child.roots["root"]
    record_path = record_path_of(root)
    segment = SHM / record_of(root)["segment"]["name"]
    for path in (record_path, segment):
        st = path.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600), path

    done = child.result()
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["uid"] == 65534
    assert out["record_paths"] == [str(record_path)]  # it saw the record's name
    assert out["opened"][record_path.name] == "PermissionError"
    assert out["opened"][segment.name] == "PermissionError"
    # Other files of the prefix: denied too, or gone meanwhile (the trainer's other slots).
    assert set(out["opened"].values()) <= {"PermissionError", "FileNotFoundError"}, out
    assert out["found"] is False
    assert out["holds"] == 0
    assert out["load"].startswith("CheckpointNotFoundError: "), out["load"]
    assert "none held in memory" in out["load"]
    assert_same_tree(make_state(2), pyshmckpt.load(root, source="memory"))  # still held for us


@pytest.mark.timeout(SMALL_SHM_TIMEOUT + 120)
@pytest.mark.skipif(not ROOT, reason="needs root, to mount a small tmpfs over /dev/shm")
@pytest.mark.skipif(UNSHARE is None, reason="needs util-linux's unshare, to mount a tmpfs apart")
def test_a_save_that_does_not_fit_beside_a_held_checkpoint_fails_cleanly(small_shm_job):
    """In a mount namespace, /dev/shm is an 8 MiB tmpfs: the held checkpoint (one 2 MiB slot) and
    the second slot of the trainer that takes it over fit; its 12 MiB state never can."""
    job = small_shm_job
    done = job.result()
    if done.returncode != 0 and done.stderr.startswith("unshare:"):
        pytest.skip(f"cannot make a mount namespace: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"cannot mount a tmpfs over /dev/shm: {out['skip']}")

    first, newcomer, second = out["first"], out["newcomer"], out["second"]
    root = job.roots["root"]
    segment = first["segment"]["name"]
    record = next(n for n in out["files_held"] if "-held-" in n)
    assert first["name"] == "step-2"
    assert out["files_held"] == sorted([segment, record])
    assert newcomer["first_slot"] == segment  # taken over
    assert newcomer["save"] == "PyshmckptOSError", newcomer
    assert newcomer["errno"] == errno.ENOSPC, newcomer
    assert newcomer["step"] == 2, newcomer  # the held checkpoint, intact
    assert newcomer["tied"], newcomer
    # Its two slots alone (the held one and the one it made): the failed save left nothing.
    assert len(newcomer["files"]) == 2, newcomer
    assert segment in newcomer["files"], newcomer
    assert second["name"] == "step-2"
    assert second["segment"]["name"] == segment
    assert second["holder"][0] == newcomer["writer"]  # the newcomer's writer holds it now
    again = next(n for n in out["files_held_again"] if "-held-" in n)  # its own record now
    assert {segment, again} <= set(out["files_held_again"])
    assert not {segment, again} & set(out["files_after_sigterm"])  # SIGTERM ended the hold
    assert visible(root) == ["step-1"]


@pytest.mark.timeout(SMALL_SHM_TIMEOUT + 120)
@pytest.mark.skipif(not ROOT, reason="needs root, to mount a small tmpfs over /dev/shm")
@pytest.mark.skipif(UNSHARE is None, reason="needs util-linux's unshare, to mount a tmpfs apart")
def test_a_trainer_that_took_a_hold_over_and_died_before_saving_leaves_no_slot_behind(
    small_shm_job,
):
    """The newcomer of the test above died after its save failed, before any save reached its
    writer: that writer holds the checkpoint again and removes the other slot the newcomer made
    (named to it at the takeover); SIGTERM then frees the rest."""
    job = small_shm_job
    done = job.result()
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"cannot mount a tmpfs over /dev/shm: {out['skip']}")
    record = next(n for n in out["files_held_again"] if "-held-" in n)
    assert out["files_held_again"] == sorted([out["second"]["segment"]["name"], record])
    assert out["files_after_sigterm"] == []


# A training script as users write it: a `with` block, a persisted save and a newer memory-only
# one, then the training fails ("error"), fails and is caught ("caught": the script goes on and
# loads), ends on purpose ("exit": sys.exit(0)), or fails before its first save ("early").
FAILING_BLOCK = textwrap.dedent(
    """
    import sys

    import torch

    import pyshmckpt

    root, how = sys.argv[1], sys.argv[2]
    try:
        with pyshmckpt.Checkpointer(root, capacity_bytes=4 << 20) as ck:
            if how == "early":
                raise RuntimeError("the training failed")
            ck.save({"w": torch.full((256,), 5.0), "step": 5}, name="step-5").result(timeout=60)
            ck.save({"w": torch.full((256,), 7.0), "step": 7}, name="step-7", persist=False)
            if how == "exit":
                sys.exit(0)
            raise RuntimeError("the training failed")
    except RuntimeError:
        if how != "caught":
            raise
    print("restored step", pyshmckpt.load(root)["step"], flush=True)
    """
)


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("how", ["error", "caught", "exit", "early"])
def test_an_exception_out_of_a_with_block_leaves_the_newest_checkpoint_held(
    tmp_path, monkeypatch, how
):
    """The end of a ``with`` block on an exception is a trainer's failure, not the job's end:
    the pending saves finish and the newest checkpoint, memory-only, stays held for the next
    trainer (as after a crash), also when the script catches the exception and goes on. A
    ``sys.exit(0)`` out of the block is a clean end, and a failure before any save has nothing
    to hold: everything is freed. Nothing of the job is left in /dev/shm once the hold ends."""
    prefix = f"{os.environ[PREFIX_VARIABLE]}-with-{how}"
    monkeypatch.setenv(PREFIX_VARIABLE, prefix)
    script_path = tmp_path / "train.py"
    script_path.write_text(FAILING_BLOCK)
    root = tmp_path / "ckpt"
    env = child_env() | {PREFIX_VARIABLE: prefix, "PYSHMCKPT_HOLD_TIMEOUT": "120"}
    left: set[str] = set()
    try:
        done = subprocess.run(
            [sys.executable, str(script_path), str(root), how], capture_output=True, text=True,
            env=env, cwd=str(tmp_path), timeout=TEST_TIMEOUT / 2,
        )  # fmt: skip
        if how in ("error", "early"):
            assert done.returncode == 1
            assert "RuntimeError: the training failed" in done.stderr
        else:
            assert done.returncode == 0, done.stderr
        if how in ("exit", "early"):
            assert "restored step" not in done.stdout
            assert records.holds(prefix) == []
            assert ours(prefix) == set()  # every slot freed
            if how == "exit":
                assert pyshmckpt.load(root)["step"] == 5  # the newest on disk
            return
        if how == "caught":  # the same process, once the block was left
            assert done.stdout.splitlines() == ["restored step 7"], done.stderr
        [(_, record)] = records.holds(prefix)
        assert record["name"] == "step-7"
        assert record["persisted"] is False
        state = pyshmckpt.load(root)  # a new trainer: this process
        assert state["step"] == 7
        assert torch.equal(state["w"], torch.full((256,), 7.0))
        assert visible(root) == ["step-5"]
    finally:
        end_holds(prefix)  # the holder frees its segment as it exits
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not ours(prefix), 10, "the holder to free its segment")
        left = ours(prefix)
        for name in left:
            (SHM / name).unlink(missing_ok=True)
    assert left == set()
