"""The Checkpointer's writer process never loads torch (issue 14): it persists the slot's bytes by
pointers and offsets, so a trainer script that imports torch still gets a writer whose memory holds
no libtorch, and whose private memory stays small."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from helpers import child_env

TRAINER = textwrap.dedent(
    """
    import json, sys

    import torch

    import pyshmckpt

    def mapped_torch(pid):
        with open(f"/proc/{pid}/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "libtorch" in line})

    def main():
        root = sys.argv[1]
        state = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "step": 3}
        with pyshmckpt.Checkpointer(root) as checkpointer:
            checkpointer.save(state, name="one")
            path = checkpointer.wait(60)[-1]
            pid = checkpointer.writer_pid
            libraries = mapped_torch(pid)
        loaded = pyshmckpt.load(path)
        print(json.dumps({
            "writer": pid, "trainer_has_torch": bool(mapped_torch("self")), "libraries": libraries,
            "same": bool(torch.equal(loaded["w"], state["w"])) and loaded["step"] == 3,
        }), flush=True)


    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.timeout(180)
def test_the_checkpointers_writer_process_does_not_load_torch(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=str(tmp_path),
        timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["trainer_has_torch"]  # the check sees libtorch where it is loaded
    assert report["same"]
    assert report["libraries"] == [], f"the writer process mapped {report['libraries']}"


WRITER_MODULES = [
    "pyshmckpt.transport.launcher",
    "pyshmckpt.transport.child",
    "pyshmckpt.storage.safetensors_writer",
    "pyshmckpt.storage.commit",
    "pyshmckpt.storage.tree_codec",
    "pyshmckpt.storage.writers",
    "pyshmckpt.staging.manifest",
    "pyshmckpt.staging.views",
    "pyshmckpt.shm.attached",
]


@pytest.mark.timeout(60)
def test_the_writer_process_modules_import_without_torch(tmp_path):
    """What the writer process imports (and `import pyshmckpt`) loads neither torch nor the
    trainer-side modules: a quick check of the import graph, beside the end-to-end one above."""
    code = (
        f"import sys, pyshmckpt; import {', '.join(WRITER_MODULES)}; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run(  # from elsewhere than a checkout (`-c` imports from the cwd first)
        [sys.executable, "-c", code],
        capture_output=True, text=True, env=child_env(), cwd=str(tmp_path), timeout=50,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


SAVE_ONCE = textwrap.dedent(
    """
    import sys

    import torch

    import pyshmckpt

    if __name__ == "__main__":
        with pyshmckpt.Checkpointer(sys.argv[1]) as checkpointer:
            checkpointer.save({"w": torch.ones(8)}, name="one").result(timeout=60)
        print("saved", flush=True)
    """
)


@pytest.mark.timeout(180)
def test_the_writer_imports_the_trainers_pyshmckpt_whatever_the_working_directory_holds(
    tmp_path,
):
    """Run from a directory holding another `pyshmckpt` (a source checkout without its compiled
    extension, as CI's clone is), the writer still imports the package the trainer imported:
    `python -c` puts the working directory first on its path."""
    cwd = tmp_path / "checkout"
    (cwd / "pyshmckpt").mkdir(parents=True)
    (cwd / "pyshmckpt" / "__init__.py").write_text("raise ImportError('the wrong pyshmckpt')\n")
    script = tmp_path / "scripts" / "save_once.py"
    script.parent.mkdir()
    script.write_text(SAVE_ONCE)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True, text=True, env=child_env(), cwd=str(cwd), timeout=150, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "saved"
    assert (tmp_path / "ckpt" / "one" / "rank0.safetensors").is_file()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("users", [None, "3"], ids=["default", "user-set"])
def test_the_writer_process_starts_no_openblas_threads_unless_asked(tmp_path, monkeypatch, users):
    import os
    from pathlib import Path

    import pyshmckpt

    if users is None:
        monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", users)
    with pyshmckpt.Checkpointer(tmp_path) as checkpointer:
        checkpointer.wait_for_writer(timeout=30)
        environ = Path(f"/proc/{checkpointer.writer_pid}/environ").read_bytes().split(b"\0")
    assert f"OPENBLAS_NUM_THREADS={users or 1}".encode() in environ
    assert os.environ.get("OPENBLAS_NUM_THREADS") == users  # the trainer's own is untouched
