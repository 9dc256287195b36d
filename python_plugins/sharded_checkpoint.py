"""Checkpoints of sharded trainer ranks: each rank writes its rows, any rank count reads them.

Rank ``r`` of ``W`` writes ``shards/rank-<r>.safetensors`` with the rows of every tensor it
holds (the first dimension, as FSDP2 shards it) and ``shards/rank-<r>.json``:

    {"format": 1, "rank": r, "world_size": W,
     "tensors": {"model/<name>": {"shape": [global shape], "rows": [start, stop]}, ...}}

Keys are ``model/<parameter>`` and ``optimizer/<parameter>/<state>`` (AdamW's ``exp_avg``,
``exp_avg_sq`` and ``step``), plus ``rng/torch``. No pickle anywhere: safetensors and JSON.
A reader for any rank count assembles the rows it needs from the overlapping pieces, so a
checkpoint of 2 ranks resumes on 1, 2 or 4.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from python_plugins.checkpoint_io import host_tensor
from python_plugins.sharding import is_sharded, local_rows
from rollout_sdk.snapshot import TensorFile

__all__ = [
    "SHARDS_DIR",
    "ShardedTensors",
    "is_sharded_checkpoint",
    "load_state",
    "shard_files",
    "state_files",
]

SHARDS_DIR = "shards"
FORMAT_VERSION = 1
_RANK_FILE = re.compile(r"rank-(\d{5})\.json")


def shard_files(
    pieces: Iterable[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, int]]], rank: int, world_size: int
) -> dict[str, bytes | TensorFile]:
    """This rank's files, from ``(key, local rows, global shape, (start, stop))`` pieces."""
    tensors = {}
    table = {}
    for key, local, shape, rows in pieces:
        tensors[key] = host_tensor(local)
        table[key] = {"shape": list(shape), "rows": list(rows)}
    metadata = {"format": FORMAT_VERSION, "rank": rank, "world_size": world_size, "tensors": table}
    stem = f"{SHARDS_DIR}/rank-{rank:05d}"
    return {
        f"{stem}.safetensors": TensorFile(tensors, {"format": "pt"}),
        f"{stem}.json": (json.dumps(metadata, indent=1) + "\n").encode(),
    }


def is_sharded_checkpoint(directory: Path) -> bool:
    return (directory / SHARDS_DIR).is_dir()


@dataclass(frozen=True, slots=True)
class _Piece:
    file: Path
    start: int
    stop: int


class ShardedTensors:
    """The tensors of a sharded checkpoint, read a range of rows at a time."""

    def __init__(self, directory: Path) -> None:
        root = directory / SHARDS_DIR
        tables = {}
        for path in sorted(root.glob("rank-*.json")):
            match = _RANK_FILE.fullmatch(path.name)
            if match is None:
                continue
            table = json.loads(path.read_text())
            if table.get("format") != FORMAT_VERSION:
                raise ValueError(f"{path}: unsupported format {table.get('format')!r}")
            tables[int(match.group(1))] = table
        if not tables:
            raise FileNotFoundError(f"no shard tables (rank-*.json) in {root}")
        world = {table["world_size"] for table in tables.values()}
        if len(world) != 1 or sorted(tables) != list(range(next(iter(world)))):
            raise ValueError(
                f"{root}: shards of ranks {sorted(tables)} with world sizes {sorted(world)}: "
                "the checkpoint is incomplete"
            )
        self.world_size = next(iter(world))
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.pieces: dict[str, list[_Piece]] = {}
        for rank, table in sorted(tables.items()):
            file = root / f"rank-{rank:05d}.safetensors"
            for key, entry in table["tensors"].items():
                self.shapes.setdefault(key, tuple(entry["shape"]))
                start, stop = entry["rows"]
                self.pieces.setdefault(key, []).append(_Piece(file, start, stop))

    def keys(self) -> list[str]:
        return list(self.shapes)

    def rows(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``key`` (all by default; a 0-dim tensor whole)."""
        if key not in self.shapes:
            raise KeyError(f"the checkpoint has no tensor `{key}`")
        shape = self.shapes[key]
        if not shape:
            piece = self.pieces[key][0]
            with safe_open(str(piece.file), framework="pt") as reader:
                return reader.get_tensor(key)
        start = 0 if start is None else start
        stop = shape[0] if stop is None else stop
        parts = []
        covered = start
        for piece in sorted(self.pieces[key], key=lambda p: p.start):
            low, high = max(piece.start, covered), min(piece.stop, stop)
            if low >= high:
                continue
            if low != covered:
                break
            with safe_open(str(piece.file), framework="pt") as reader:
                parts.append(reader.get_slice(key)[low - piece.start : high - piece.start])
            covered = high
        if covered != stop:
            raise ValueError(f"the checkpoint's shards of `{key}` do not cover rows {start}..{stop}")
        if not parts:
            with safe_open(str(self.pieces[key][0].file), framework="pt") as reader:
                return reader.get_slice(key)[0:0]
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def state_files(
    trainable: Iterable[tuple[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    rank: int,
    world_size: int,
) -> dict[str, bytes | TensorFile]:
    """This rank's rows of the trainable parameters (by checkpoint key) and their optimizer state."""
    pieces = []
    for key, param in trainable:
        pieces.append(_piece(f"model/{key}", param))
        for name, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                pieces.append(_piece(f"optimizer/{key}/{name}", value))
    rng = torch.get_rng_state()
    pieces.append(("rng/torch", rng, tuple(rng.shape), (0, rng.shape[0])))
    return shard_files(pieces, rank, world_size)


def _piece(key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor, tuple[int, ...], tuple[int, int]]:
    local = tensor.to_local() if is_sharded(tensor) else tensor
    return key, local.detach(), tuple(tensor.shape), local_rows(tensor)


@torch.no_grad()
def load_state(
    directory: Path, trainable: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer
) -> None:
    """Copy this rank's rows of every parameter and its optimizer state in, from a checkpoint of
    any rank count."""
    source = ShardedTensors(directory)
    trainable = list(trainable)
    wanted = {f"model/{key}" for key, _ in trainable}
    unknown = sorted(k for k in source.keys() if k.startswith("model/") and k not in wanted)
    if unknown:
        raise ValueError(f"{directory}: the model has no parameter `{unknown[0][len('model/') :]}`")
    fused = any(group.get("fused") for group in optimizer.param_groups)
    for key, param in trainable:
        if f"model/{key}" not in source.shapes:
            raise ValueError(f"{directory}: parameter `{key}` is missing")
        saved = source.shapes[f"model/{key}"]
        if saved != tuple(param.shape):
            raise ValueError(
                f"{directory}: `{key}` has shape {list(saved)}, the model expects {list(param.shape)}"
            )
        start, stop = local_rows(param)
        local = param.to_local() if is_sharded(param) else param
        local.copy_(source.rows(f"model/{key}", start, stop))
        prefix = f"optimizer/{key}/"
        state = {}
        for name in (k for k in source.keys() if k.startswith(prefix)):
            value = source.rows(name) if not source.shapes[name] else source.rows(name, start, stop)
            state[name[len(prefix) :]] = _like(value, param, local, fused)
        if state:
            optimizer.state[param] = state
    torch.set_rng_state(source.rows("rng/torch"))


def _like(value: torch.Tensor, param: torch.Tensor, local: torch.Tensor, fused: bool) -> torch.Tensor:
    """A saved optimizer value placed as the optimizer keeps it for ``param``."""
    if value.dim() == 0:
        # Fused AdamW keeps its step counter on the parameters' device, as float32.
        return value.to(local.device, torch.float32) if fused else value
    value = value.to(local.device)
    if is_sharded(param):
        return DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            shape=param.shape,
            stride=param.stride(),
            run_check=False,
        )
    return value
