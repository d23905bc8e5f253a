"""NumPy and CuPy arrays through the Checkpointer and back (pyshmckpt/storage/reader.py,
rank_files.py, resharding.py for ``into=``): saved as entries of the safetensors file like
tensors, flagged in rank<r>.json, loaded as the same kind of array.

No GPU here: the CuPy side of `load` is checked with a rank file whose rows are flagged CUPY (a
NumPy checkpoint with its flags edited), for the errors without CuPy or a device, for
``cupy_as="numpy"``, and, with a stand-in ``cupy`` module, for the conversion's control flow
(never a GPU claim). The real CuPy round trip is marked ``gpu``.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pyshmckpt
from pyshmckpt import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    ConfigError,
    CupyUnavailableError,
    UnsupportedValueError,
)

from helpers import SAVE_TIMEOUT, opened

NUMPY, CUPY = 4, 8  # the "flags" bits of rank<r>.json


def arrays_state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    buf = rng.standard_normal(32).astype(np.float32)
    owned = np.arange(10, dtype=np.int64)
    return {
        "model": {
            "w": torch.randn(4, 4),
            "f32": rng.standard_normal((3, 4)).astype(np.float32),
            "i64": rng.integers(-(2**40), 2**40, (5,)),
            "bool": rng.integers(0, 2, (7,)).astype(bool),
            "f16": rng.standard_normal((2, 3)).astype(np.float16),
            "u8": rng.integers(0, 256, (9,)).astype(np.uint8),
            "c64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
        },
        "scalar": np.array(2.5),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "strided": buf[::3],
        "transposed": rng.standard_normal((3, 5)).T,
        "buf": buf,
        "head": buf[:8],
        "tail": buf[8:].reshape(4, 6),
        "owned": owned,
        "owned_tensor": torch.from_numpy(owned),
        "step": 3,
    }


def check_loaded(loaded: Any, want: Any, path: str = "state") -> None:
    """Same structure; arrays as arrays of the same dtype, shape and values."""
    assert type(loaded) is type(want), f"{path}: {type(loaded)} is not {type(want)}"
    if isinstance(want, dict):
        assert list(loaded) == list(want), path
        for key in want:
            check_loaded(loaded[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, np.ndarray):
        assert loaded.dtype == want.dtype, path
        assert loaded.shape == want.shape, path
        assert np.array_equal(loaded, want), path
    elif isinstance(want, torch.Tensor):
        assert torch.equal(loaded, want), path
    else:
        assert loaded == want, path


@pytest.fixture(scope="module")
def arrays_checkpoint(shared) -> tuple[Path, dict[str, Any]]:
    state = arrays_state()
    path = shared.save(state, name="arrays").result(timeout=SAVE_TIMEOUT)
    return path, state


def copy_with_flags(tmp_path: Path, source: Path, flags: dict[str, int]) -> Path:
    """A copy of the checkpoint `source` whose rows named in `flags` have those flags."""
    target = tmp_path / "edited"
    shutil.copytree(source, target)
    manifest = target / "rank0.json"
    described = json.loads(manifest.read_text())
    for row in described["tensors"]:
        if row["name"] in flags:
            row["flags"] = flags[row["name"]]
    manifest.write_text(json.dumps(described))
    return target


# -- NumPy arrays ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [False, True], ids=["in-memory", "mmap"])
def test_arrays_come_back_as_arrays(arrays_checkpoint, mmap):
    path, state = arrays_checkpoint
    loaded = pyshmckpt.load(path, mmap=mmap)
    check_loaded(loaded, state)
    assert pyshmckpt.verify(path) == 16
    # Views of one buffer share memory again; so do an array and a tensor over its memory.
    assert np.shares_memory(loaded["buf"], loaded["head"])
    assert np.shares_memory(loaded["buf"], loaded["tail"])
    assert np.shares_memory(loaded["owned"], loaded["owned_tensor"].numpy())
    loaded["head"][0] = 123.0
    assert loaded["buf"][0] == 123.0


def test_the_manifest_flags_arrays_and_safetensors_reads_them_as_entries(arrays_checkpoint):
    path, state = arrays_checkpoint
    rows = {row["name"]: row for row in json.loads((path / "rank0.json").read_text())["tensors"]}
    assert rows["model.f32"]["flags"] == NUMPY
    assert rows["model.w"]["flags"] == 0
    assert rows["owned_tensor"]["flags"] == 0
    assert rows["owned"]["flags"] == NUMPY
    numpy_file = pytest.importorskip("safetensors.numpy")
    entries = numpy_file.load_file(str(path / "rank0.safetensors"))
    assert np.array_equal(entries["model.f32"], state["model"]["f32"])
    assert np.array_equal(entries["model.c64"], state["model"]["c64"])
    assert np.array_equal(entries["scalar"], state["scalar"])


def test_load_into_fills_arrays_in_place(arrays_checkpoint):
    path, state = arrays_checkpoint
    target = {
        "model": {
            key: np.zeros_like(value) if isinstance(value, np.ndarray) else torch.zeros_like(value)
            for key, value in state["model"].items()
        },
        "scalar": np.zeros(()),
        "strided": np.zeros(11, dtype=np.float32)[::1],
        "buf": np.empty(64, dtype=np.float32)[::2],  # a strided target
        "owned_tensor": torch.zeros(10, dtype=torch.int64),
        "owned": np.zeros(10, dtype=np.int64),
        "step": 0,
    }
    arrays_before = {key: target["model"][key] for key in target["model"]}
    memory = target["model"]["f32"].__array_interface__["data"][0]
    assert pyshmckpt.load(path, into=target) is target
    for key, value in arrays_before.items():
        assert target["model"][key] is value, f"{key} was replaced, not filled"
    assert target["model"]["f32"].__array_interface__["data"][0] == memory
    for key in state["model"]:
        want = state["model"][key]
        got = target["model"][key]
        assert np.array_equal(np.asarray(got), np.asarray(want)), key
    assert np.array_equal(target["buf"], state["buf"])
    assert np.array_equal(target["strided"], state["strided"])
    assert float(target["scalar"]) == 2.5
    assert np.array_equal(target["owned"], state["owned"])
    assert target["step"] == 3


def test_load_into_a_tensor_from_an_array_and_the_reverse(arrays_checkpoint):
    path, state = arrays_checkpoint
    target = {"model": {"f32": torch.zeros(3, 4), "w": np.zeros((4, 4), dtype=np.float32)}}
    pyshmckpt.load(path, into=target)
    assert torch.equal(target["model"]["f32"], torch.from_numpy(state["model"]["f32"]))
    assert np.array_equal(target["model"]["w"], state["model"]["w"].numpy())


def test_load_into_refuses_arrays_it_cannot_fill(arrays_checkpoint):
    path, _ = arrays_checkpoint
    frozen = np.zeros((3, 4), dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(CheckpointMismatchError, match=r"\['f32'\]: the target is a read-only"):
        pyshmckpt.load(path, into={"model": {"f32": frozen}})
    with pytest.raises(CheckpointMismatchError, match="shape"):
        pyshmckpt.load(path, into={"model": {"f32": np.zeros((4, 3), dtype=np.float32)}})
    with pytest.raises(CheckpointMismatchError, match="cannot be filled in place"):
        pyshmckpt.load(path, into={"model": {"f32": np.zeros((3, 4), dtype=">f4")}})


def test_arrays_torch_cannot_view_are_refused_at_save(shared):
    state = {"opt": {"objects": np.array([None, 1], dtype=object)}}
    with pytest.raises(UnsupportedValueError) as info:
        shared.save(state, name="refused")
    assert info.value.path == "state_dict['opt']['objects']"
    assert not (shared.root / "refused").exists()


def test_the_torch_writer_gets_arrays_too(tmp_path):
    state = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "t": torch.ones(2)}
    with opened(tmp_path, writer="torch") as ck:
        path = ck.save(state, name="t").result(timeout=SAVE_TIMEOUT)
    saved = torch.load(path / "checkpoint_0.pt", weights_only=False)
    assert type(saved["a"]) is np.ndarray
    assert np.array_equal(saved["a"], state["a"])


@pytest.mark.parametrize(
    ("row", "flags"),
    [("model.f32", NUMPY | CUPY), ("model.f32", NUMPY | 2), ("model.w", NUMPY | 1)],
    ids=["numpy-and-cupy", "requires-grad", "parameter"],
)
def test_impossible_array_flags_are_reported_as_corrupt(arrays_checkpoint, tmp_path, row, flags):
    path, _ = arrays_checkpoint
    edited = copy_with_flags(tmp_path, path, {row: flags})
    with pytest.raises(CheckpointCorruptError, match="malformed tensor description"):
        pyshmckpt.load(edited)


def test_an_array_flag_on_a_dtype_numpy_lacks_is_corrupt(shared, tmp_path):
    path = shared.save({"b": torch.ones(3, dtype=torch.bfloat16)}, name="bf16").result(
        timeout=SAVE_TIMEOUT
    )
    edited = copy_with_flags(tmp_path, path, {"b": NUMPY})
    with pytest.raises(CheckpointCorruptError, match="bfloat16 array"):
        pyshmckpt.load(edited)


def test_rows_without_array_flags_load_as_tensors(arrays_checkpoint, tmp_path):
    """A checkpoint written before arrays were staged has no such bit: its rows are tensors."""
    path, state = arrays_checkpoint
    edited = copy_with_flags(tmp_path, path, {"model.f32": 0})
    loaded = pyshmckpt.load(edited)
    assert type(loaded["model"]["f32"]) is torch.Tensor
    assert np.array_equal(loaded["model"]["f32"].numpy(), state["model"]["f32"])


# -- CuPy arrays at load, without a GPU -----------------------------------------------------------


@pytest.fixture(scope="module")
def cupy_checkpoint(shared, tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of arrays with some rows flagged CUPY, as a save of CuPy arrays flags them
    (and no tensor, which map_location would move to a device)."""
    rng = np.random.default_rng(1)
    buf = np.arange(24, dtype=np.float32)
    state = {
        "model": {
            "f32": rng.standard_normal((3, 4)).astype(np.float32),
            "c64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
            "i64": np.arange(5),
        },
        "buf": buf,
        "head": buf[:8],
        "tail": buf[8:].reshape(4, 4),
        "empty": np.zeros((0, 2), dtype=np.uint8),
        "step": 3,
    }
    path = shared.save(state, name="cupy").result(timeout=SAVE_TIMEOUT)
    names = ("model.f32", "model.c64", "buf", "head", "tail", "empty")
    edited = copy_with_flags(tmp_path_factory.mktemp("cupy"), path, dict.fromkeys(names, CUPY))
    return edited, state


def test_cupy_arrays_without_cupy_raise_naming_the_array(cupy_checkpoint, monkeypatch):
    path, _ = cupy_checkpoint
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(CupyUnavailableError) as info:
        pyshmckpt.load(path)
    message = str(info.value)
    assert "'model.f32' first" in message
    assert "python -m pip install 'cupy-cuda12x>=13'" in message
    assert "cupy_as='numpy'" in message


def test_cupy_arrays_without_a_device_raise(cupy_checkpoint, monkeypatch):
    path, _ = cupy_checkpoint
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(devices=0))
    with pytest.raises(CupyUnavailableError, match="no CUDA device"):
        pyshmckpt.load(path)


def test_cupy_arrays_load_as_numpy_on_request(cupy_checkpoint, monkeypatch):
    path, state = cupy_checkpoint
    monkeypatch.setitem(sys.modules, "cupy", None)
    loaded = pyshmckpt.load(path, cupy_as="numpy")
    check_loaded(loaded, state)
    assert np.shares_memory(loaded["buf"], loaded["tail"])
    with pytest.raises(ConfigError, match="cupy_as"):
        pyshmckpt.load(path, cupy_as="cuda")


@pytest.mark.parametrize("mmap", [False, True], ids=["in-memory", "mmap"])
def test_cupy_conversion_control_flow_with_a_stand_in_module(cupy_checkpoint, monkeypatch, mmap):
    """Control flow of the conversion (one host-to-device copy per storage, views into it with
    the saved offsets and strides, map_location's device), over a stand-in for CuPy whose
    "device" memory is host memory. Not a GPU test."""
    path, state = cupy_checkpoint
    cupy = fake_cupy(devices=2)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    loaded = pyshmckpt.load(path, map_location="cuda:1", mmap=mmap)
    for key in ("f32", "c64"):
        got = loaded["model"][key]
        assert isinstance(got, FakeDeviceArray), key
        assert got.host.dtype == state["model"][key].dtype, key
        assert np.array_equal(got.host, state["model"][key]), key
    for key in ("buf", "head", "tail", "empty"):
        assert isinstance(loaded[key], FakeDeviceArray), key
        assert loaded[key].host.dtype == state[key].dtype, key
        assert np.array_equal(loaded[key].host, state[key]), key
    assert np.shares_memory(loaded["buf"].host, loaded["tail"].host)  # one copy of the buffer
    assert cupy.copies == 3  # f32, c64 and the buffer, each once
    assert cupy.devices_used == [1, 1, 1]
    assert type(loaded["model"]["i64"]) is np.ndarray  # NumPy rows stay NumPy
    assert loaded["step"] == 3


class FakeMemoryPointer:
    def __init__(self, buffer: np.ndarray, offset: int = 0) -> None:
        self.buffer = buffer
        self.offset = offset

    def __add__(self, n: int) -> FakeMemoryPointer:
        return FakeMemoryPointer(self.buffer, self.offset + n)


class FakeDeviceArray:
    """What the stand-in's asarray/ndarray/empty return: a NumPy array (`host`) as the data."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = host
        self.data = FakeMemoryPointer(host)


def fake_cupy(devices: int) -> Any:
    """A stand-in for the parts of CuPy that `load` uses (a module in sys.modules)."""
    current = [0]
    cupy = types.SimpleNamespace(copies=0, devices_used=[])

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> Device:
            current.append(self.index)
            return self

        def __exit__(self, *exc: object) -> None:
            current.pop()

    def asarray(host: np.ndarray) -> FakeDeviceArray:
        cupy.copies += 1
        cupy.devices_used.append(current[-1])
        return FakeDeviceArray(np.array(host, copy=True))

    def ndarray(shape: Any, dtype: Any, memptr: FakeMemoryPointer, strides: Any) -> Any:
        return FakeDeviceArray(
            np.ndarray(shape, dtype, buffer=memptr.buffer, offset=memptr.offset, strides=strides)
        )

    cupy.asarray = asarray
    cupy.ndarray = ndarray
    cupy.empty = lambda shape, dtype: FakeDeviceArray(np.empty(shape, dtype=dtype))
    cupy.cuda = types.SimpleNamespace(
        Device=Device, runtime=types.SimpleNamespace(getDeviceCount=lambda: devices)
    )
    return cupy


# -- CuPy on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cupy_arrays_round_trip_on_a_gpu(tmp_path):
    cupy = pytest.importorskip("cupy")
    base = cupy.arange(24, dtype=cupy.float32)
    state = {
        "a": cupy.random.standard_normal((3, 4)).astype(cupy.float32),
        "whole": base,
        "view": base[4:12],
        "i": cupy.arange(5, dtype=cupy.int64),
        "t": torch.ones(3, device="cuda"),
    }
    with opened(tmp_path) as ck:
        staged = ck._stager.stage(state)  # the staged copy: NumPy arrays over the slot
        assert type(staged["a"]) is np.ndarray
        assert np.array_equal(staged["a"], cupy.asnumpy(state["a"]))
        del staged
        path = ck.save(state, name="c").result(timeout=SAVE_TIMEOUT)
    loaded = pyshmckpt.load(path)
    for key in ("a", "whole", "view", "i"):
        assert isinstance(loaded[key], cupy.ndarray), key
        assert bool((loaded[key] == state[key]).all()), key
    assert cupy.shares_memory(loaded["whole"], loaded["view"])
    as_numpy = pyshmckpt.load(path, cupy_as="numpy")
    assert type(as_numpy["a"]) is np.ndarray
    target = {key: cupy.zeros_like(state[key]) for key in ("a", "i")}
    pyshmckpt.load(path, into=target)
    assert bool((target["a"] == state["a"]).all())
