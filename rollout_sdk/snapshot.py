"""What ``Policy.snapshot`` returns: a checkpoint as files, for the engine to write.

A snapshot maps paths (relative to the checkpoint's policy directory) to a file's content:
``bytes``, or a :class:`TensorFile` that the engine writes as safetensors. The engine copies
every tensor's bytes before ``snapshot`` returns, so a :class:`HostTensor` may view live
memory (a CPU tensor's storage) and training can change it right after.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["HostTensor", "Snapshot", "TensorFile", "write_snapshot"]

#: Bytes per element of each safetensors dtype; tensors are laid out widest first, so each
#: starts aligned to its own element size.
ITEM_BYTES = {
    "F64": 8,
    "I64": 8,
    "F32": 4,
    "I32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
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
        """Write the file here as safetensors, each tensor straight from its buffer: no copy of
        the whole file is ever in memory (the engine writes snapshots itself)."""
        ordered = sorted(self.tensors.items(), key=lambda item: (-ITEM_BYTES.get(item[1].dtype, 1), item[0]))
        header: dict[str, Any] = {"__metadata__": dict(self.metadata)} if self.metadata else {}
        views = []
        offset = 0
        for name, tensor in ordered:
            if tensor.dtype not in ITEM_BYTES:
                raise ValueError(f"tensor `{name}`: unknown safetensors dtype {tensor.dtype!r}")
            view = memoryview(tensor.data).cast("B")
            expected = math.prod(tensor.shape) * ITEM_BYTES[tensor.dtype]
            if view.nbytes != expected:
                raise ValueError(
                    f"tensor `{name}`: {view.nbytes} bytes for shape {tensor.shape} of "
                    f"{tensor.dtype}, which takes {expected}"
                )
            header[name] = {
                "dtype": tensor.dtype,
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + view.nbytes],
            }
            offset += view.nbytes
            views.append(view)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        # The data starts 8-byte aligned, as safetensors' own writer pads it.
        encoded += b" " * (-len(encoded) % 8)
        with open(path, "wb") as file:
            file.write(len(encoded).to_bytes(8, "little"))
            file.write(encoded)
            for view in views:
                file.write(view)


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
