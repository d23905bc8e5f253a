"""pyshmckpt.load and verify (pyshmckpt/storage/reader.py, inspection.py, rank_files.py): what
a checkpoint written by the safetensors writer reads back as, and that no damage to its files
goes unreported or crashes.

The checkpoints come from the module's shared Checkpointer (conftest: `shared`, `gpt_checkpoint`);
corruption tests damage copies of them.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import pyshmckpt
from pyshmckpt import CheckpointCorruptError, Checkpointer
from pyshmckpt.cli import main as cli_main
from pyshmckpt.shm import native
from pyshmckpt.staging.manifest import DTYPES
from pyshmckpt.storage import inspection, rank_files, reader

from helpers import (
    SAVE_TIMEOUT,
    assert_same_tree,
    flip_tensor_byte,
    names_in,
    opened,
    read_st_header,
    same_bytes,
    snapshot,
    write_st_header,
)

# --------------------------------------------------------------------------------------------
# round trip through the safetensors writer
# --------------------------------------------------------------------------------------------


def test_round_trip_of_a_transformer_and_adamw_state(gpt_checkpoint, shared):
    path, expected = gpt_checkpoint["path"], gpt_checkpoint["expected"]
    assert path == shared.root / "gpt"
    assert sorted(names_in(path)) == ["commit.json", "rank0.json", "rank0.safetensors"]

    loaded = pyshmckpt.load(path)
    assert_same_tree(expected, loaded)

    # Container types: the module's OrderedDict (with its _metadata), int keys of the optimizer
    # state, tuples (AdamW betas) inside param_groups, the plain int leaf.
    assert type(loaded["model"]) is collections.OrderedDict
    assert loaded["model"]._metadata == expected["model"]._metadata
    assert all(type(k) is int for k in loaded["optim"]["state"])
    group = loaded["optim"]["param_groups"][0]
    assert type(group["betas"]) is tuple
    assert group["betas"] == (0.9, 0.999)
    assert group["params"] == expected["optim"]["param_groups"][0]["params"]
    assert loaded["step"] == 3
    assert type(loaded["step"]) is int

    # Tied embeddings come back as aliases of one buffer.
    model = loaded["model"]
    assert model["embed.weight"].data_ptr() == model["head.weight"].data_ptr()
    assert (
        model["embed.weight"].untyped_storage().data_ptr()
        == model["head.weight"].untyped_storage().data_ptr()
    )

    # verify() agrees and counts every tensor.
    n_tensors = len(json.loads((path / "rank0.json").read_text())["tensors"])
    assert pyshmckpt.verify(path) == n_tensors
    # A file of the checkpoint names it too.
    assert_same_tree(expected, pyshmckpt.load(path / "rank0.safetensors"))


def test_loaded_state_resumes_training_exactly(gpt_checkpoint):
    from conftest import TinyGPT, train_step

    ref_model, ref_opt = copy.deepcopy(gpt_checkpoint["reference"])
    loaded = pyshmckpt.load(gpt_checkpoint["path"])

    torch.manual_seed(123)  # a different initialisation: everything must come from the checkpoint
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optim"])
    assert model.head.weight is model.embed.weight  # still tied after loading

    for seed in (1, 2, 3):  # the later steps depend on the restored AdamW moments and step
        expected_loss = train_step(ref_model, ref_opt, seed=seed)
        loss = train_step(model, optimizer, seed=seed)
        assert loss == expected_loss, f"step with seed {seed}: {loss!r} != {expected_loss!r}"
    for (name, p), (_, q) in zip(
        model.state_dict().items(), ref_model.state_dict().items(), strict=True
    ):
        assert same_bytes(p, q), name


def test_safetensors_library_reads_the_file(gpt_checkpoint):
    st = pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    path, expected = gpt_checkpoint["path"], gpt_checkpoint["expected"]
    tensors = load_file(str(path / "rank0.safetensors"))
    with st.safe_open(str(path / "rank0.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pyshmckpt"

    model = expected["model"]
    present = {key for key in model if f"model.{key}" in tensors}
    for key in present:
        assert same_bytes(tensors[f"model.{key}"], model[key]), key
    # A key is absent only when it aliases a stored one (the tied head shares the embedding).
    for key in set(model) - present:
        assert any(model[key].data_ptr() == model[k].data_ptr() for k in present), (
            f"model.{key} missing"
        )
    assert "model.embed.weight" in tensors
    assert "model.pos" in tensors
    # The optimizer's moments are ordinary named tensors too.
    for index, slot in expected["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bytes(tensors[f"optim.state.{index}.{key}"], slot[key]), (index, key)


def test_load_into_copies_in_place(gpt_checkpoint):
    from conftest import TinyGPT

    torch.manual_seed(7)
    model = TinyGPT()
    target = {"model": model.state_dict()}
    pointers = {k: v.data_ptr() for k, v in target["model"].items()}
    result = pyshmckpt.load(gpt_checkpoint["path"], into=target)
    assert result is target
    expected = gpt_checkpoint["expected"]["model"]
    for key, value in target["model"].items():
        assert value.data_ptr() == pointers[key], f"{key} was replaced, not copied into"
        assert same_bytes(value, expected[key]), key
    # The module itself now holds the checkpoint's weights (its state_dict tensors are views).
    assert same_bytes(model.embed.weight, expected["embed.weight"])
    assert same_bytes(model.head.weight, expected["embed.weight"])


def test_load_into_sets_the_targets_other_leaves_to_the_checkpoints(tmp_path):
    saved = {
        "w": torch.arange(4.0),
        "groups": [{"lr": 0.05, "betas": (0.9, 0.95), "params": ["w"]}],
        "step": 7,
        "note": None,
    }
    with Checkpointer(tmp_path) as checkpointer:
        path = checkpointer.save(saved, name="ck").result(timeout=60)
    target = {
        "w": torch.zeros(4),
        "groups": [{"lr": 0.1, "betas": (0.8, 0.9), "params": ["w"]}],
        "step": 0,
        "note": "fresh",
    }
    w = target["w"]
    assert pyshmckpt.load(path, into=target) is target
    assert target["w"] is w  # filled in place
    assert torch.equal(w, saved["w"])
    assert target["groups"] == saved["groups"]
    assert target["step"] == 7
    assert target["note"] is None


def test_load_into_rejects_a_different_structure(gpt_checkpoint):
    path = gpt_checkpoint["path"]
    with pytest.raises(ValueError, match="pos"):
        pyshmckpt.load(path, into={"model": {"pos": torch.zeros(3, 3)}})
    with pytest.raises(KeyError, match="nonexistent"):
        pyshmckpt.load(path, into={"model": {"nonexistent": torch.zeros(1)}})


# --------------------------------------------------------------------------------------------
# corruption
# --------------------------------------------------------------------------------------------


def _truncate(size: Callable[[int], int]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        st = d / "rank0.safetensors"
        os.truncate(st, size(st.stat().st_size))

    return damage


def _edit_tensor(**changes: Any) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        manifest = json.loads((d / "rank0.json").read_text())
        for item in manifest["tensors"]:
            if item["name"] == "model.pos":
                item.update(changes)
        (d / "rank0.json").write_text(json.dumps(manifest))

    return damage


def _edit_manifest(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        manifest = json.loads((d / "rank0.json").read_text())
        edit(manifest)
        (d / "rank0.json").write_text(json.dumps(manifest))

    return damage


def _header_past_the_end(d: Path) -> None:
    st = d / "rank0.safetensors"
    _, header = read_st_header(st)
    last = max(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1]
    )
    header[last]["data_offsets"][1] += 1 << 20
    write_st_header(st, header)


def _header_overlapping(d: Path) -> None:
    st = d / "rank0.safetensors"
    _, header = read_st_header(st)
    second = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
    )[1]
    header[second]["data_offsets"] = [
        x - 4 for x in header[second]["data_offsets"]
    ]  # overlaps the first
    write_st_header(st, header)


@dataclasses.dataclass(frozen=True)
class Corruption:
    damage: Callable[[Path], None]
    file: str  # the file the error must name
    tensor: str | None = None  # the tensor (or entry) it must name
    reason: str = ""  # a fragment of its reason
    by_inspect: bool = True  # `pyshmckpt inspect` (descriptions only) detects it too
    structural: bool = True  # found without checksums: load(verify=False) reports it too
    source: str = "gpt"  # the checkpoint damaged: "gpt" or "ints"


def _int_tensors_require_grad(manifest: dict[str, Any]) -> None:
    for item in manifest["tensors"]:
        if item["dtype"] == "int64":
            item["flags"] = 2  # REQUIRES_GRAD, which only floating-point tensors can have


ST, JS = "rank0.safetensors", "rank0.json"
CHECKSUM_ONLY = {"by_inspect": False, "structural": False}
TREE_ONLY = {"by_inspect": False}  # inspect lists tensors, it does not rebuild the structure
CORRUPTIONS: dict[str, Corruption] = {
    "flipped-byte": Corruption(flip_tensor_byte, ST, "model.pos", "checksum", **CHECKSUM_ONLY),
    "truncated-data": Corruption(_truncate(lambda n: n - 100), ST, None, "truncated"),
    "truncated-header": Corruption(_truncate(lambda n: 100), ST, None, "truncated"),
    "truncated-length": Corruption(_truncate(lambda n: 5), ST, None, "8-byte"),
    "empty-data-file": Corruption(_truncate(lambda n: 0), ST),
    "missing-manifest": Corruption(lambda d: (d / JS).unlink(), JS, None, "missing"),
    "missing-data-file": Corruption(lambda d: (d / ST).unlink(), ST, None, "missing"),
    "manifest-not-json": Corruption(lambda d: (d / JS).write_text("{"), JS, None, "unreadable"),
    "manifest-not-ours": Corruption(lambda d: (d / JS).write_text("[1]"), JS, None, "not a"),
    "offset-outside-entry": Corruption(_edit_tensor(offset=8192), ST, "model.pos", "outside"),
    "shape-outside-entry": Corruption(_edit_tensor(shape=[64, 33]), ST, "model.pos", "outside"),
    "stride-outside-entry": Corruption(_edit_tensor(stride=[33, 1]), ST, "model.pos", "outside"),
    "negative-offset": Corruption(_edit_tensor(offset=-4), ST, "model.pos", "invalid"),
    "unknown-entry": Corruption(_edit_tensor(entry="nope"), ST, "model.pos", "not in the file"),
    "entry-not-a-string": Corruption(_edit_tensor(entry=["model.pos"]), ST, "model.pos"),
    "unknown-dtype": Corruption(_edit_tensor(dtype="float99"), ST, "model.pos", "malformed"),
    "integer-tensor-requires-grad": Corruption(
        _edit_manifest(_int_tensors_require_grad), ST, "ids", source="ints"
    ),
    "no-checksum": Corruption(
        _edit_manifest(lambda m: m["entries"].pop("model.pos")),
        ST,
        "model.pos",
        "no checksum",
        **CHECKSUM_ONLY,
    ),  # fmt: skip
    "checksum-of-a-missing-entry": Corruption(
        _edit_manifest(lambda m: m["entries"].update(ghost={"crc32c": 1})),
        ST,
        "ghost",
        "missing",
        **CHECKSUM_ONLY,
    ),  # fmt: skip
    "tree-index-out-of-range": Corruption(
        _edit_manifest(lambda m: m.update(tree={"t": 10**6})), JS, None, "structure", **TREE_ONLY
    ),
    "tree-garbage": Corruption(
        _edit_manifest(lambda m: m.update(tree=[1])), JS, None, "structure", **TREE_ONLY
    ),
    "header-offsets-past-the-end": Corruption(_header_past_the_end, ST, None, "past the end"),
    "header-overlap": Corruption(_header_overlapping, ST, None, "overlap"),
}


@pytest.fixture(scope="module")
def int_checkpoint(shared: Checkpointer) -> Path:
    """A checkpoint with an integer tensor (for the requires-grad case)."""
    state = {"ids": torch.arange(16), "w": torch.ones(4)}
    return shared.save(state, name="with-ints").result(SAVE_TIMEOUT)


def _check_reported(case: Corruption, d: Path, call: Callable[[], Any]) -> None:
    with pytest.raises(CheckpointCorruptError) as info:
        call()
    exc = info.value
    assert isinstance(exc, ValueError)  # documented: a ValueError too
    assert Path(exc.path) == d / case.file, str(exc)
    if case.tensor is not None:
        assert exc.tensor == case.tensor, str(exc)
        assert f"[{case.tensor}]" in str(exc)
    assert case.reason in exc.reason, str(exc)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_is_reported_never_a_crash(
    kind, tmp_path, gpt_checkpoint, int_checkpoint, capsys
):
    case = CORRUPTIONS[kind]
    d = tmp_path / "ckpt"
    shutil.copytree(int_checkpoint if case.source == "ints" else gpt_checkpoint["path"], d)
    case.damage(d)

    _check_reported(case, d, lambda: pyshmckpt.load(d))
    if case.structural:
        _check_reported(case, d, lambda: pyshmckpt.load(d, verify=False))
    _check_reported(case, d, lambda: pyshmckpt.verify(d))

    # The command line (in-process here; test_command_line_verify_and_inspect runs the real
    # entry point) reports it, names the file, and exits 1 without a traceback.
    capsys.readouterr()
    assert cli_main(["verify", str(d)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("CORRUPT: "), err
    assert str(d / case.file) in err
    if case.by_inspect:
        assert cli_main(["inspect", str(d)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("CORRUPT: "), err
        assert str(d / case.file) in err


def test_flipped_byte_loads_without_verification_and_differs(tmp_path, gpt_checkpoint):
    d = tmp_path / "ckpt"
    shutil.copytree(gpt_checkpoint["path"], d)
    flip_tensor_byte(d)
    loaded = pyshmckpt.load(d, verify=False)  # the caller opted out: no error, no crash
    expected = gpt_checkpoint["expected"]["model"]
    assert not same_bytes(loaded["model"]["pos"], expected["pos"])
    assert same_bytes(loaded["model"]["embed.weight"], expected["embed.weight"])


def test_a_load_leaves_the_garbage_collector_as_it_found_it(tmp_path, gpt_checkpoint):
    # A load pauses automatic collection while it parses the manifest and builds the state; a
    # load that fails must not leave it off, nor turn it on where the caller had it off.
    d = tmp_path / "ckpt"
    shutil.copytree(gpt_checkpoint["path"], d)
    pyshmckpt.load(d)
    assert gc.isenabled()
    flip_tensor_byte(d)
    with pytest.raises(CheckpointCorruptError):
        pyshmckpt.load(tmp_path)  # the root: restore's listing and the reader's both run
    assert gc.isenabled()
    gc.disable()
    try:
        pyshmckpt.load(d, verify=False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_root_without_checkpoints_is_reported(tmp_path):
    with pytest.raises(CheckpointCorruptError, match="missing"):
        pyshmckpt.load(tmp_path)
    with pytest.raises(CheckpointCorruptError, match="missing"):
        pyshmckpt.verify(tmp_path / "nope")


# --------------------------------------------------------------------------------------------
# loading to another device
# --------------------------------------------------------------------------------------------


def test_load_to_another_device_keeps_tied_weights_tied(gpt_checkpoint):
    """With a map_location other than the CPU ("meta" stands for any device here), tensors that
    share a storage share one there too (they used to be moved as independent copies)."""
    model = pyshmckpt.load(gpt_checkpoint["path"], map_location="meta")["model"]
    assert model["embed.weight"].device.type == "meta"
    embed = model["embed.weight"].untyped_storage()._cdata
    assert model["head.weight"].untyped_storage()._cdata == embed, (
        "tied weights were moved as two copies"
    )


def test_load_to_another_device_keeps_module_metadata(gpt_checkpoint):
    """The module state dict's OrderedDict keeps its _metadata when moved (it used to be dropped
    by OrderedDict.copy())."""
    model = pyshmckpt.load(gpt_checkpoint["path"], map_location="meta")["model"]
    assert type(model) is collections.OrderedDict
    assert getattr(model, "_metadata", None) == gpt_checkpoint["expected"]["model"]._metadata


def test_moving_differently_typed_views_of_one_entry(shared):
    """Regression: _move reused the storage made for the first (shorter, float32) base of the entry."""
    from pyshmckpt.storage import reader

    u8 = torch.arange(10, dtype=torch.uint8)
    state = {"f": u8[:8].view(torch.float32), "u": u8}
    path = shared.save(state, name="mixed-dtypes").result(timeout=SAVE_TIMEOUT)
    loaded = pyshmckpt.load(path)
    assert same_bytes(loaded["f"], state["f"])
    assert same_bytes(loaded["u"], u8)
    moved = reader._move(loaded, torch.device("cpu"))
    assert same_bytes(moved["f"], state["f"])
    assert same_bytes(moved["u"], u8)
    assert moved["f"].untyped_storage().data_ptr() == moved["u"].untyped_storage().data_ptr()


@pytest.mark.parametrize("mmap", [False, True], ids=["in-memory", "mapped"])
def test_a_tensor_that_is_its_whole_entry_keeps_its_views_and_flags(shared, mmap):
    """A row that is the whole of its entry is the entry's own tensor; the rows that view it
    share its storage, and gradient flags land on the right tensors whatever the row order."""
    weight = torch.nn.Parameter(torch.randn(4, 6))
    leaf = torch.randn(5, 3).requires_grad_(True)
    plain = torch.arange(12.0)
    state = {
        "view_first": plain[2:8],  # a view saved ahead of the tensor it views
        "plain": plain,
        "plain_again": plain,  # the same tensor under two keys
        "weight": weight,
        "weight_t": weight.detach().t(),
        "leaf": leaf,
        "leaf_row": leaf.detach()[1],
    }
    path = shared.save(state, name=f"whole-entry-{mmap}").result(timeout=SAVE_TIMEOUT)
    loaded = pyshmckpt.load(path, mmap=mmap)
    for key, value in state.items():
        assert same_bytes(loaded[key].detach(), value.detach()), key
    assert isinstance(loaded["weight"], torch.nn.Parameter)
    assert loaded["weight"].requires_grad
    assert loaded["leaf"].requires_grad
    assert loaded["leaf"].is_leaf
    assert not loaded["leaf_row"].requires_grad
    assert not loaded["weight_t"].requires_grad
    assert not loaded["plain"].requires_grad

    def storage(key: str) -> int:
        return loaded[key].untyped_storage().data_ptr()

    assert storage("view_first") == storage("plain") == storage("plain_again")
    assert storage("weight") == storage("weight_t")
    assert storage("leaf") == storage("leaf_row")
    loaded["plain"][3] = -1.0  # an alias sees a write through another
    assert loaded["view_first"][1] == -1.0
    assert loaded["plain_again"][3] == -1.0
    loaded["leaf_row"].sum()  # usable views, no autograd error
    (loaded["leaf"] * 2).sum().backward()
    assert loaded["leaf"].grad is not None


def test_load_without_mmap_reads_into_memory_and_keeps_tied_weights_tied(gpt_checkpoint, tmp_path):
    path = shutil.copytree(gpt_checkpoint["path"], tmp_path / "copy")
    mapped = pyshmckpt.load(path, mmap=True)
    in_memory = pyshmckpt.load(path)  # the default on the CPU: read into memory
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert str(path) in maps  # the mapped load keeps the file mapped while its tensors live
    assert_same_tree(mapped, in_memory)
    model = in_memory["model"]
    assert (
        model["head.weight"].untyped_storage()._cdata
        == model["embed.weight"].untyped_storage()._cdata
    )
    del mapped
    gc.collect()
    assert str(path) not in Path("/proc/self/maps").read_text()  # nothing maps it any more
    assert_same_tree(gpt_checkpoint["expected"], in_memory)


# --------------------------------------------------------------------------------------------
# the parallel read path: preads straight into memory, checksums from the landed bytes
# --------------------------------------------------------------------------------------------

MIB = 1 << 20
HUGE = "huge"  # a float32 entry of 20 MiB: split into pieces read by different threads
MANY = 2000  # small tensors, each an entry of its own


def _random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _every_dtype() -> dict[str, torch.Tensor]:
    """A tensor of random bits for every dtype the manifest knows that torch can hold as plain
    bytes (quantized and sub-byte integer dtypes cannot be made from bytes)."""
    out = {}
    for i, (name, dtype) in enumerate(DTYPES.items()):
        if name.startswith(("qint", "quint")) or name[-1] in "1234567" and "int" in name:
            continue
        if dtype == torch.bool:
            out[name] = torch.randint(0, 2, (37,), dtype=torch.bool)
        else:
            out[name] = _random_bytes(48 * dtype.itemsize, i).view(dtype)
    return out


def test_every_dtype_round_trips_in_torchs_deterministic_mode(tmp_path):
    # torch.use_deterministic_algorithms(True) (as Lightning's deterministic=True sets it) fills
    # new memory, and torch has no fill for the bits, sub-byte and float4 dtypes: staging and
    # loading must not make tensors of those with torch.empty. (conftest puts the mode back.)
    state = _every_dtype()
    state.update({f"{name}, empty": t[:0] for name, t in list(state.items())})
    target = {
        name: torch.zeros(t.nbytes, dtype=torch.uint8).view(t.dtype).view(t.shape)
        for name, t in state.items()
    }
    torch.use_deterministic_algorithms(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # complex32 is "experimental"
        with Checkpointer(tmp_path) as checkpointer:
            checkpointer.save(state, name="every-dtype").result(timeout=SAVE_TIMEOUT)
        loaded = pyshmckpt.load(tmp_path / "every-dtype")
        filled = pyshmckpt.load(tmp_path / "every-dtype", into=target)
    assert filled is target
    for name, t in state.items():
        assert same_bytes(loaded[name], t), name
        assert same_bytes(target[name], t), name


@pytest.fixture(scope="module")
def threads() -> Any:
    """Four native threads, whatever the machine has, so that reads really run in parallel."""
    before = native.copy_threads()
    native.set_copy_threads(4)
    yield 4
    native.set_copy_threads(before)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory, threads: int) -> dict[str, Any]:
    """One huge tensor, MANY small ones of mixed dtypes, every dtype, and tied views."""
    del threads
    huge = _random_bytes(20 * MIB, 1).view(torch.float32)
    kinds = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16]
    many = {
        f"t{i}": _random_bytes(64 + 8 * (i % 7), i + 10).view(kinds[i % len(kinds)])
        for i in range(MANY)
    }
    base = torch.arange(64, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # complex32 is "experimental"
        state = {
            HUGE: huge,
            "many": many,
            "dtypes": _every_dtype(),
            "tied": {"base": base, "view": base[8:40].view(4, 8), "again": base},
            "step": 3,
        }
        expected = snapshot(state)
    root = tmp_path_factory.mktemp("big-root")
    with opened(root, capacity_bytes=32 * MIB) as ck:
        path = ck.save(state, name="big").result(SAVE_TIMEOUT)
    return {"path": path, "expected": expected}


def test_default_load_reads_every_dtype_bit_for_bit(big_checkpoint):
    loaded = pyshmckpt.load(big_checkpoint["path"])
    assert_same_tree(big_checkpoint["expected"], loaded)
    for name, t in loaded["dtypes"].items():
        assert same_bytes(t, big_checkpoint["expected"]["dtypes"][name]), name
    # Each entry in memory of its own: no file map left, independent storages.
    assert str(big_checkpoint["path"]) not in Path("/proc/self/maps").read_text()
    assert (
        loaded[HUGE].untyped_storage().data_ptr()
        != loaded["many"]["t0"].untyped_storage().data_ptr()
    )
    # Tied storages are still views of one block.
    tied = loaded["tied"]
    assert tied["view"].untyped_storage().data_ptr() == tied["base"].untyped_storage().data_ptr()
    assert tied["again"].untyped_storage().data_ptr() == tied["base"].untyped_storage().data_ptr()
    assert torch.equal(tied["view"], tied["base"][8:40].view(4, 8))


def test_mapped_load_reads_the_same(big_checkpoint):
    assert_same_tree(big_checkpoint["expected"], pyshmckpt.load(big_checkpoint["path"], mmap=True))


def _zeros_like_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeros_like_tree(v) for k, v in tree.items()}
    return tree


def test_load_into_reads_straight_into_the_targets(big_checkpoint):
    expected = big_checkpoint["expected"]
    target = _zeros_like_tree(expected)
    base = torch.zeros(64, dtype=torch.float64)  # tied in the target as in the checkpoint
    target["tied"] = {"base": base, "view": base[8:40].view(4, 8), "again": base}
    target["step"] = 0
    pointers = {name: t.data_ptr() for name, t in target["many"].items()}
    huge_ptr, version = target[HUGE].data_ptr(), target[HUGE]._version
    assert pyshmckpt.load(big_checkpoint["path"], into=target) is target
    assert_same_tree(expected, target)
    assert target[HUGE].data_ptr() == huge_ptr
    assert target[HUGE]._version > version  # written in place, as copy_ would have
    assert all(t.data_ptr() == pointers[name] for name, t in target["many"].items())
    assert target["tied"]["base"].data_ptr() == base.data_ptr()
    assert target["step"] == 3


def test_load_into_targets_that_cannot_be_read_into_directly(big_checkpoint):
    """Non-contiguous targets, a parameter, another dtype's storage and a slice of a bigger
    storage are filled by copies; the result is the same."""
    expected = big_checkpoint["expected"]
    target = _zeros_like_tree(expected)
    target[HUGE] = torch.nn.Parameter(torch.zeros_like(expected[HUGE]))
    wide = torch.zeros(2 * 48, dtype=torch.float64)
    target["dtypes"]["float64"] = wide[::2]  # non-contiguous
    target["dtypes"]["float32"] = torch.zeros(100, dtype=torch.float32)[:48]  # part of a storage
    target["many"]["t1"] = torch.zeros(
        expected["many"]["t1"].shape[0] * 2, dtype=expected["many"]["t1"].dtype
    )[1::2]
    pyshmckpt.load(big_checkpoint["path"], into=target)
    huge = target.pop(HUGE)
    assert huge.requires_grad
    assert same_bytes(huge.detach(), expected[HUGE])
    assert_same_tree({k: v for k, v in expected.items() if k != HUGE}, target)


def _flip_in_the_middle(path: Path, entry: str) -> None:
    st = path / "rank0.safetensors"
    start, header = read_st_header(st)
    begin, end = header[entry]["data_offsets"]
    with st.open("r+b") as f:
        f.seek(start + (begin + end) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("entry", [HUGE, "many.t1500"])
def test_a_flipped_byte_is_found_on_the_parallel_path(big_checkpoint, tmp_path, entry):
    d = shutil.copytree(big_checkpoint["path"], tmp_path / "ckpt")
    _flip_in_the_middle(d, entry)
    for call in (
        lambda: pyshmckpt.load(d),
        lambda: pyshmckpt.load(d, into=_zeros_like_tree(big_checkpoint["expected"])),
    ):
        with pytest.raises(CheckpointCorruptError) as info:
            call()
        assert Path(info.value.path) == d / "rank0.safetensors"
        assert info.value.tensor == entry
        assert "checksum" in info.value.reason
    # Without verification it loads, with the flipped bit.
    assert (
        not same_bytes(pyshmckpt.load(d, verify=False)[HUGE], big_checkpoint["expected"][HUGE])
        or entry != HUGE
    )


def test_an_entry_the_target_does_not_use_is_still_verified(big_checkpoint, tmp_path):
    d = shutil.copytree(big_checkpoint["path"], tmp_path / "ckpt")
    _flip_in_the_middle(d, "many.t7")
    target = _zeros_like_tree(big_checkpoint["expected"])
    del target["many"]
    with pytest.raises(CheckpointCorruptError, match="checksum") as info:
        pyshmckpt.load(d, into=target)
    assert info.value.tensor == "many.t7"


def test_a_file_truncated_while_loading_is_reported(big_checkpoint, tmp_path):
    d = shutil.copytree(big_checkpoint["path"], tmp_path / "ckpt")
    st = d / "rank0.safetensors"
    opened_files = rank_files.open_rank(d, 0)  # header checked against the whole file
    with opened_files[5]:
        os.truncate(st, st.stat().st_size - 3 * MIB)  # then the file shrinks
        with pytest.raises(CheckpointCorruptError, match="ends inside the entry") as info:
            reader._rank_file(opened_files, 0, False, verify_all=True, in_memory=True)
    assert Path(info.value.path) == st
    assert info.value.tensor is not None


def test_verify_and_describe_leave_no_map_of_the_file(int_checkpoint: Path) -> None:
    def maps_of_the_file() -> int:
        with Path("/proc/self/maps").open() as maps:
            return sum(str(int_checkpoint) in line for line in maps)

    assert maps_of_the_file() == 0
    assert pyshmckpt.verify(int_checkpoint) == 2
    assert maps_of_the_file() == 0
    assert [row["name"] for row in inspection.describe(int_checkpoint)] == ["ids", "w"]
    assert maps_of_the_file() == 0
