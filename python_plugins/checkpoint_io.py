"""Optimizer state and RNG state as safetensors + JSON, so checkpoints never need pickle.

Tensors (Adam moments, step counters, RNG states) go to ``optimizer.safetensors`` under
``state.<param index>.<key>`` and ``rng.*``; hyperparameters, non-tensor state and the
parameter index -> name table go to ``optimizer.json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["load_optimizer", "save_optimizer"]

TENSORS_FILE = "optimizer.safetensors"
METADATA_FILE = "optimizer.json"
FORMAT_VERSION = 1


def save_optimizer(directory: Path, optimizer: torch.optim.Optimizer, param_names: Sequence[str]) -> None:
    """Write ``optimizer``'s state (its params named by ``param_names``, in order) and RNG states."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for device, rng in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{device}"] = rng
    metadata = {
        "format": FORMAT_VERSION,
        "parameters": list(param_names),
        "param_groups": state["param_groups"],
        "scalar_state": scalars,
    }
    save_file(tensors, str(directory / TENSORS_FILE))
    (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")


def load_optimizer(directory: Path, optimizer: torch.optim.Optimizer, param_names: Sequence[str]) -> None:
    """Restore what :func:`save_optimizer` wrote into ``optimizer`` and the RNG states."""
    metadata = json.loads((directory / METADATA_FILE).read_text())
    if metadata.get("format") != FORMAT_VERSION:
        raise ValueError(f"{directory / METADATA_FILE}: unsupported format {metadata.get('format')!r}")
    _check_same_parameters(metadata["parameters"], param_names, directory)
    tensors = load_file(str(directory / TENSORS_FILE))
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        if name.startswith("state."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = tensor
    for index, values in metadata["scalar_state"].items():
        state.setdefault(int(index), {}).update(values)
    groups = [
        _restore_tuples(saved, current)
        for saved, current in zip(metadata["param_groups"], optimizer.param_groups, strict=True)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(tensors["rng.torch"])
    cuda_keys = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.split(".")[2]))
    if cuda_keys and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda_keys])


def _check_same_parameters(saved: Sequence[str], current: Sequence[str], directory: Path) -> None:
    for index, (before, now) in enumerate(zip(saved, current, strict=False)):
        if before != now:
            raise ValueError(
                f"{directory / METADATA_FILE}: optimizer parameter {index} is `{before}`, "
                f"the model has `{now}` there"
            )
    if len(saved) != len(current):
        raise ValueError(
            f"{directory / METADATA_FILE}: optimizer holds {len(saved)} parameters, the model {len(current)}"
        )


def _restore_tuples(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """JSON turns tuples (e.g. Adam's ``betas``) into lists; give them their original type back."""
    return {
        key: tuple(value) if isinstance(current.get(key), tuple) else value for key, value in saved.items()
    }
