"""FSDP2 sharding of a Hugging Face causal LM over the trainers' process group.

``fully_shard`` wraps every decoder block (the classes the model lists in
``_no_split_modules``) and then the root, which holds the embeddings, the final norm and the
LM head. Parameters are sharded along their first dimension in ``torch.chunk`` pieces, one
per rank; a block's parameters are gathered for its forward and backward passes only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rollout_sdk import Sharding

__all__ = ["check_shardable", "gathered_on_rank0", "is_sharded", "local_rows", "shard_model"]


def check_shardable(config: Any) -> None:
    """Options of ``HFCausalLM.Config`` that sharding cannot honour, refused with the fix."""
    if config.quantization != "none" or config.reference_quantization != "none":
        raise ValueError(
            'sharding = "fsdp" cannot shard bitsandbytes-quantized weights: use quantization = "none" '
            "(a sharded bfloat16 base takes less memory per rank than a replicated 4-bit one from 4 ranks on)"
        )
    if config.offload_optimizer:
        raise ValueError(
            'offload_optimizer moves a replicated optimizer to the CPU; with sharding = "fsdp" set '
            "[train.fsdp] offload = true instead, which offloads the sharded parameters, gradients "
            "and optimizer state"
        )
    if config.optimizer != "adamw":
        raise ValueError('sharding = "fsdp" needs optimizer = "adamw" (8-bit AdamW has no DTensor support)')


def shard_model(model: torch.nn.Module, sharding: Sharding) -> FSDPModule:
    """Shard ``model`` in place, block by block and at the root, as ``sharding`` says."""
    options: dict[str, Any] = {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=_dtype(sharding.param_dtype), reduce_dtype=_dtype(sharding.reduce_dtype)
        ),
        "reshard_after_forward": sharding.reshard_after_forward,
    }
    if sharding.offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in block_names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no decoder block class in `_no_split_modules`: "
            "sharding it whole would gather every weight at once"
        )
    for block in blocks:
        fully_shard(block, **options)
    root = fully_shard(model, **options)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            # The engine's losses are pre-scaled for a sum over ranks; gloo has no pre-scaled
            # sum (PREMUL_SUM), so reduce with a plain sum.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


def _dtype(name: str) -> torch.dtype | None:
    if not name:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown floating-point dtype {name!r}")
    return dtype


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def local_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """The rows ``[start, stop)`` of ``tensor``'s first dimension this rank holds.

    FSDP2 shards in ``torch.chunk`` pieces: ``ceil(rows / world)`` per rank, the last ranks
    holding fewer (or none).
    """
    rows = tensor.shape[0] if tensor.dim() else 1
    if not isinstance(tensor, DTensor):
        return 0, rows
    world = tensor.device_mesh.size()
    rank = tensor.device_mesh.get_local_rank()
    chunk = math.ceil(rows / world)
    start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    held = tensor.to_local().shape[0] if tensor.dim() else 1
    if held != stop - start:
        raise RuntimeError(
            f"a shard holds {held} rows where torch.chunk gives {stop - start}: not an FSDP2 shard"
        )
    return start, stop


def gathered_on_rank0(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor whole, as float32 NumPy, one at a time, on rank 0; nothing on other ranks.

    Every rank must iterate to the end: each sharded tensor is one ``gather`` to rank 0, so
    rank 0 never holds more than one gathered tensor besides its shards.
    """
    rank = dist.get_rank()
    for name, tensor in named:
        whole = _gather(tensor.detach()) if isinstance(tensor, DTensor) else tensor.detach()
        if rank == 0 and whole is not None:
            yield name, whole.to("cpu", dtype=torch.float32).numpy()


def _gather(tensor: DTensor) -> torch.Tensor | None:
    mesh = tensor.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = tensor.shape[0]
    chunk = math.ceil(rows / world)
    local = tensor.to_local()
    device = (
        torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    )
    padded = torch.zeros((chunk, *tensor.shape[1:]), dtype=local.dtype, device=device)
    padded[: local.shape[0]].copy_(local)
    pieces = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, pieces, dst=0, group=mesh.get_group())
    if pieces is None:
        return None
    return torch.cat(pieces)[:rows]
