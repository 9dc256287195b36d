"""Checkpoint files as safetensors + JSON, so checkpoints never need pickle.

The model is stored as ``save_pretrained`` would store it. Optimizer tensors (Adam moments,
step counters, RNG states) go to ``optimizer.safetensors`` under ``state.<param index>.<key>``
and ``rng.*``; hyperparameters, non-tensor state and the parameter index -> name table go to
``optimizer.json``. Files are returned as snapshot contents (``rollout_sdk.snapshot``): the
engine copies the tensors and writes them in the background.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rollout_sdk.snapshot import HostTensor, TensorFile

__all__ = ["host_tensor", "load_optimizer", "model_files", "optimizer_files", "tokenizer_files"]

TENSORS_FILE = "optimizer.safetensors"
METADATA_FILE = "optimizer.json"
FORMAT_VERSION = 1
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def host_tensor(tensor: torch.Tensor) -> HostTensor:
    """A view of ``tensor``'s bytes in host memory (a copy only when it lives on a device)."""
    host = tensor.detach().to("cpu").contiguous()
    return HostTensor(
        SAFETENSORS_DTYPES[host.dtype], tuple(host.shape), host.reshape(-1).view(torch.uint8).numpy()
    )


def model_files(model: Any, tokenizer: Any, *, weights: bool = True) -> dict[str, bytes | TensorFile]:
    """What ``save_pretrained`` writes for ``model`` and ``tokenizer``, as snapshot contents
    (without ``model.safetensors`` unless ``weights``).

    Tied tensors are stored once, under their first name, as ``save_pretrained`` does.
    """
    files: dict[str, bytes | TensorFile] = {"config.json": model.config.to_json_string().encode()}
    if model.can_generate() and model.generation_config is not None:
        files["generation_config.json"] = model.generation_config.to_json_string().encode()
    files.update(tokenizer_files(tokenizer))
    if weights:
        files["model.safetensors"] = TensorFile(_untied(model.state_dict()), {"format": "pt"})
    return files


def tokenizer_files(tokenizer: Any) -> dict[str, bytes | TensorFile]:
    """What the tokenizer's ``save_pretrained`` writes."""
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save_pretrained(scratch)
        return {path.name: path.read_bytes() for path in Path(scratch).iterdir() if path.is_file()}


def _untied(state: Mapping[str, torch.Tensor]) -> dict[str, HostTensor]:
    seen: set[tuple[str, int]] = set()
    untied = {}
    for name, tensor in state.items():
        storage = (str(tensor.device), tensor.untyped_storage().data_ptr())
        if storage not in seen:
            seen.add(storage)
            untied[name] = host_tensor(tensor)
    return untied


def optimizer_files(
    optimizer: torch.optim.Optimizer, param_names: Sequence[str]
) -> dict[str, bytes | TensorFile]:
    """``optimizer``'s state (params named by ``param_names``, in order) and the RNG states."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value
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
    return {
        TENSORS_FILE: TensorFile({name: host_tensor(tensor) for name, tensor in tensors.items()}),
        METADATA_FILE: (json.dumps(metadata, indent=2) + "\n").encode(),
    }


def load_optimizer(directory: Path, optimizer: torch.optim.Optimizer, param_names: Sequence[str]) -> None:
    """Restore the files of :func:`optimizer_files` into ``optimizer`` and the RNG states."""
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
