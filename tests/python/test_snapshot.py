"""``TensorFile.write``: safetensors written straight from each tensor's buffer."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from python_plugins.checkpoint_io import host_tensor
from rollout_sdk.snapshot import HostTensor, TensorFile


def mixed_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(5, 3, generator=generator),
        "step": torch.tensor(7, dtype=torch.int64),
        "half": torch.randn(3, generator=generator).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
    }


def test_the_file_reads_back_as_safetensors_writes_it(tmp_path: Path) -> None:
    tensors = mixed_tensors()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    TensorFile({name: host_tensor(t) for name, t in tensors.items()}, {"format": "pt"}).write(ours)
    save_file(tensors, str(theirs), {"format": "pt"})

    loaded = load_file(str(ours))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name
    with safe_open(str(ours), "pt") as file:
        assert file.metadata() == {"format": "pt"}
    # The same layout as the library's own writer: widest dtypes first, so every tensor is
    # aligned to its element size, and the data starts on an 8-byte boundary.
    assert ours.stat().st_size == theirs.stat().st_size
    header_bytes = int.from_bytes(ours.read_bytes()[:8], "little")
    assert header_bytes % 8 == 0
    header = json.loads(ours.read_bytes()[8 : 8 + header_bytes])
    itemsize = {"F32": 4, "I64": 8, "BF16": 2, "BOOL": 1, "U8": 1}
    for name, entry in header.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % itemsize[entry["dtype"]] == 0, name


def test_a_large_tensor_is_written_without_a_copy_of_it(tmp_path: Path) -> None:
    weights = np.ones(8 << 20, dtype=np.float32)  # 32 MiB
    file = TensorFile({"w": HostTensor("F32", (weights.size,), weights.view(np.uint8))})
    tracemalloc.start()
    try:
        file.write(tmp_path / "w.safetensors")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["w"], torch.ones(8 << 20))


def test_bytes_that_do_not_fill_the_shape_are_refused(tmp_path: Path) -> None:
    file = TensorFile({"w": HostTensor("F32", (2, 2), np.zeros(12, dtype=np.uint8))})
    with pytest.raises(ValueError, match="`w`: 12 bytes for shape \\(2, 2\\) of F32, which takes 16"):
        file.write(tmp_path / "w.safetensors")


def test_an_unknown_dtype_is_refused(tmp_path: Path) -> None:
    file = TensorFile({"w": HostTensor("F8_E4M3", (2,), b"\x00\x01")})
    with pytest.raises(ValueError, match="unknown safetensors dtype 'F8_E4M3'"):
        file.write(tmp_path / "w.safetensors")
