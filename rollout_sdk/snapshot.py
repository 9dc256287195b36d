"""What ``Policy.snapshot`` returns: a checkpoint as files, for the engine to write.

A snapshot maps paths (relative to the checkpoint's policy directory) to a file's content:
``bytes``, or a :class:`TensorFile` that the engine writes as safetensors. The engine copies
every tensor's bytes before ``snapshot`` returns, so a :class:`HostTensor` may view live
memory (a CPU tensor's storage) and training can change it right after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["HostTensor", "Snapshot", "TensorFile", "write_snapshot"]

TORCH_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


@dataclass(frozen=True, slots=True)
class HostTensor:
    """One tensor in host memory.

    ``dtype`` is the safetensors name (``"F32"``, ``"BF16"``, ``"I64"``...); ``data`` is any
    contiguous buffer of its bytes in C order (a ``uint8`` NumPy array, ``bytes``).
    """

    dtype: str
    shape: tuple[int, ...]
    data: Any


@dataclass(frozen=True, slots=True)
class TensorFile:
    """A safetensors file: tensors by name and the file's string metadata."""

    tensors: Mapping[str, HostTensor]
    metadata: Mapping[str, str] = field(default_factory=dict)

    def write(self, path: str | Path) -> None:
        """Write the file here with torch and safetensors (the engine writes snapshots itself)."""
        import torch
        from safetensors.torch import save_file

        tensors = {
            name: torch.frombuffer(bytearray(tensor.data), dtype=torch.uint8)
            .view(getattr(torch, TORCH_DTYPES[tensor.dtype]))
            .reshape(tensor.shape)
            for name, tensor in self.tensors.items()
        }
        save_file(tensors, str(path), dict(self.metadata) or None)


Snapshot = Mapping[str, "bytes | TensorFile"]


def write_snapshot(files: Snapshot, directory: str | Path) -> None:
    """Write a snapshot's files under ``directory``, refusing paths that leave it."""
    root = Path(directory).resolve()
    for name, content in files.items():
        path = root / name
        if root not in path.resolve().parents:
            raise ValueError(f"snapshot file `{name}` is not inside the checkpoint")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, TensorFile):
            content.write(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            raise TypeError(f"snapshot file `{name}` is {type(content).__name__}, not bytes or TensorFile")
