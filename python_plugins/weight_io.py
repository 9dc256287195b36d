"""A model's weights in and out, checked by name and shape: float32 NumPy copies or read-only
views of its parameters for the engine, a weight sync's tensors copied (or aliased) into them,
and every tensor of a safetensors model directory loaded back."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from rollout_sdk.weights import StreamedWeights

__all__ = ["float32_copies", "float32_views", "import_into_parameters", "load_safetensors_weights"]


def float32_copies(named: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, np.ndarray]:
    """Each parameter copied to the CPU as float32 (NumPy has no bfloat16)."""
    return {name: p.detach().to("cpu", dtype=torch.float32, copy=True).numpy() for name, p in named}


def float32_views(named: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, np.ndarray]:
    """``float32_copies`` without the copies: a float32 parameter on the CPU is lent as a
    read-only view of itself."""
    return {name: _read_only(p.detach().to("cpu", dtype=torch.float32).numpy()) for name, p in named}


@torch.no_grad()
def import_into_parameters(
    params: Mapping[str, torch.nn.Parameter], weights: Mapping[str, np.ndarray]
) -> None:
    """Copies each tensor into its parameter. A weight sync's ``StreamedWeights`` is taken
    one tensor at a time, and a float32 parameter on the CPU then becomes a view of the
    received bytes instead of a copy of them (they never change, and nothing on a
    generation worker writes its weights); weights at hand are checked whole first, so a
    bad mapping changes nothing."""
    streamed = isinstance(weights, StreamedWeights)
    if not streamed:
        for name, value in weights.items():
            _check_import(name, value, params)
        _check_complete(weights.keys(), params)
    imported = set()
    with warnings.catch_warnings():
        # The arrays are read-only views of the received bytes; they are only read here.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, value in weights.items():
            _check_import(name, value, params)
            received = torch.from_numpy(np.asarray(value))
            param = params[name]
            if streamed and _can_alias(param, received):
                param.data = received
            else:
                param.copy_(received)
            imported.add(name)
    _check_complete(imported, params)


@torch.no_grad()
def load_safetensors_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Copy every tensor of ``model_dir/*.safetensors`` in; tied copies may be left out."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    saved: dict[str, torch.Tensor] = {}
    for file in files:
        saved.update(load_file(str(file)))
    current = model.state_dict()
    unknown = sorted(set(saved) - set(current))
    if unknown:
        raise ValueError(f"{model_dir}: the model has no tensor `{unknown[0]}`")
    loaded_storage = {current[name].data_ptr() for name in saved}
    missing = [
        name for name in current if name not in saved and current[name].data_ptr() not in loaded_storage
    ]
    if missing:
        raise ValueError(f"{model_dir}: tensor `{missing[0]}` is missing")
    for name, tensor in saved.items():
        _check_shape(name, tuple(tensor.shape), tuple(current[name].shape), str(model_dir))
    for name, tensor in saved.items():
        current[name].copy_(tensor)


def _check_import(name: str, value: np.ndarray, params: Mapping[str, torch.nn.Parameter]) -> None:
    if name not in params:
        raise ValueError(f"import_weights: the model has no parameter `{name}`")
    _check_shape(name, tuple(value.shape), tuple(params[name].shape), "import_weights")


def _can_alias(param: torch.nn.Parameter, received: torch.Tensor) -> bool:
    return (
        param.device.type == "cpu"
        and param.dtype == received.dtype
        and received.is_contiguous()
        and received.data_ptr() % received.element_size() == 0
    )


def _check_complete(names: Iterable[str], params: Mapping[str, torch.nn.Parameter]) -> None:
    missing = sorted(set(params) - set(names))
    if missing:
        raise ValueError(f"import_weights: parameter `{missing[0]}` is missing")


def _check_shape(name: str, got: tuple[int, ...], expected: tuple[int, ...], where: str) -> None:
    if got != expected:
        raise ValueError(
            f"{where}: tensor `{name}` has shape {list(got)}, the model expects {list(expected)}"
        )


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
