"""``pyshmckpt verify`` and ``inspect`` as a user runs them (``python -m pyshmckpt``), and ``gc``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from helpers import child_env, flip_tensor_byte

CLI_TIMEOUT = 120.0


def test_command_line_verify_and_inspect(tmp_path, gpt_checkpoint):
    path = gpt_checkpoint["path"]
    corrupt = tmp_path / "corrupt"
    shutil.copytree(path, corrupt)
    flip_tensor_byte(corrupt)
    commands = {
        "verify-ok": ["verify", str(path)],
        "verify-corrupt": ["verify", str(corrupt)],
        "inspect": ["inspect", str(path)],
    }
    # Started together: each one imports torch, which is most of its time.
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-m", "pyshmckpt", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=str(tmp_path),
        )  # fmt: skip
        for key, args in commands.items()
    }
    results = {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=CLI_TIMEOUT)
            results[key] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    n_tensors = len(json.loads((path / "rank0.json").read_text())["tensors"])
    rc, out, err = results["verify-ok"]
    assert rc == 0, err
    assert out.startswith("OK: ")
    assert f"{n_tensors} tensors" in out

    rc, out, err = results["verify-corrupt"]
    assert rc == 1, (out, err)
    assert "Traceback" not in err
    assert str(corrupt / "rank0.safetensors") in err
    assert "[model.pos]" in err
    assert "checksum" in err

    rc, out, err = results["inspect"]
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["tensor", "dtype", "shape", "bytes"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert len(rows) == n_tensors
    assert "float32" in rows["model.embed.weight"]
    assert "(97, 32)" in rows["model.embed.weight"]
    assert "(64, 32)" in rows["model.pos"]
    assert "8,192" in rows["model.pos"]
    assert "float32" in rows["optim.state.0.step"]
    assert "()" in rows["optim.state.0.step"]
    # The tied head is listed under its own name, stored in the embedding's entry.
    assert rows["model.head.weight"].split()[-1] == "model.embed.weight"
    assert lines[-1].startswith(f"{n_tensors} tensors")


def test_gc_and_the_command_line_load_no_torch(tmp_path):
    """`pyshmckpt gc` (a job's epilogue runs it on every node) and building the command line
    import neither torch nor the demo's run: a fraction of a second, not torch's seconds."""
    code = (
        "import sys; from pyshmckpt.cli import main; code = main(['gc', '--dry-run']); "
        "print(code, sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or m == 'pyshmckpt.cli.demo.run'))"
    )
    done = subprocess.run(  # from elsewhere than a checkout (`-c` imports from the cwd first)
        [sys.executable, "-c", code],
        capture_output=True, text=True, env=child_env(), cwd=str(tmp_path), timeout=CLI_TIMEOUT,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout
