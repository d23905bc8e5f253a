"""pyshmckpt/_torch_private.py: every private part of torch pyshmckpt relies on exists in the
installed torch, and the wrappers do what the arena needs of them."""

from __future__ import annotations

import os

import pytest
import torch

from pyshmckpt import _torch_private

EXPERIMENTAL = [
    (module, name) for module, names in _torch_private.EXPERIMENTAL.items() for name in names
]


@pytest.mark.parametrize(("where", "name"), _torch_private.REQUIRED, ids=lambda x: str(x))
def test_required_private_api_exists(where, name):
    try:
        _torch_private.resolve(where, name)
    except (AttributeError, ImportError) as exc:
        pytest.fail(
            f"torch {torch.__version__} has no {where}.{name}, which pyshmckpt relies on "
            f"(pyshmckpt/_torch_private.py): {exc!r}"
        )


@pytest.mark.parametrize(("module", "name"), EXPERIMENTAL, ids=lambda x: str(x))
def test_experimental_api_exists(module, name):
    try:
        _torch_private.experimental(module, name)
    except (AttributeError, ImportError) as exc:
        pytest.fail(
            f"torch {torch.__version__} has no {_torch_private.EXPERIMENTAL_PACKAGE}.{module}.{name}, "
            f"which pyshmckpt's stager protocol or demo uses: {exc!r}"
        )


def test_a_missing_name_is_reported_as_missing():
    with pytest.raises(AttributeError):
        _torch_private.resolve("torch._C", "_no_such_function_in_torch")
    assert _torch_private.experimental_or_none("staging", "NoSuchStager") is None


def test_shared_fd_storage_maps_the_file_and_counts_its_users(tmp_path):
    path = tmp_path / "segment"
    path.write_bytes(bytes(range(256)) * 16)
    fd = os.open(path, os.O_RDWR)
    try:
        storage = _torch_private.shared_fd_storage(fd, 4096)
    finally:
        os.close(fd)
    view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (4096,), (1,))
    assert view[:4].tolist() == [0, 1, 2, 3]
    before = _torch_private.storage_use_count(storage)
    extra = view[10:20]
    assert _torch_private.storage_use_count(storage) == before + 1
    del extra
    assert _torch_private.storage_use_count(storage) == before
    view.fill_(7)  # writes reach the file: it is a shared mapping
    assert path.read_bytes()[:3] == b"\x07\x07\x07"
