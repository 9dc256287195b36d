"""Data-parallel training across trainer processes, on torch.distributed.

The Rust trainer role calls :func:`init_process_group` once (``env://`` rendezvous, as under
``torchrun``: ``MASTER_ADDR`` and ``MASTER_PORT`` name rank 0) and :func:`all_reduce_gradients`
after the micro-batches of every update and before ``Policy.apply_update``. Every rank's
micro-batch losses are already scaled by the whole update's token count, so the summed
gradients are exactly those of one process training on every micro-batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["COMPRESSION_DTYPES", "all_reduce_gradients", "init_process_group"]

# Gradient compression as in torch's DDP communication hooks (fp16/bf16_compress_hook):
# gradients travel in half precision and are summed there, then cast back.
COMPRESSION_DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def init_process_group(
    backend: str,
    rank: int,
    world_size: int,
    parameters: Sequence[torch.nn.Parameter] = (),
    timeout_seconds: float = 600.0,
) -> None:
    """Join the trainers' process group.

    ``backend`` "auto" is NCCL when the policy's parameters live on a CUDA device, else gloo
    (a CPU policy on a GPU machine all-reduces with gloo).
    """
    if dist.is_initialized():
        return
    on_cuda = any(p.device.type == "cuda" for p in parameters)
    if backend == "auto":
        backend = "nccl" if on_cuda else "gloo"
    if backend == "nccl" and not on_cuda:
        raise ValueError("cluster.backend = 'nccl' needs the policy on a CUDA device; use 'gloo' or 'auto'")
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_seconds),
    )


def all_reduce_gradients(
    parameters: Sequence[torch.nn.Parameter], compression: str = "none"
) -> dict[str, float]:
    """Sum every parameter's gradient over the group, in one flattened bucket per device.

    A rank without micro-batches this update contributes zeros. Returns the bytes this rank
    put into the all-reduce and the seconds it took.
    """
    if compression not in COMPRESSION_DTYPES:
        raise ValueError(
            f"unknown gradient compression {compression!r}; use one of {sorted(COMPRESSION_DTYPES)}"
        )
    started = time.perf_counter()
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    wire = flat.to(COMPRESSION_DTYPES[compression])
    dist.all_reduce(wire, op=dist.ReduceOp.SUM)
    if wire.dtype != flat.dtype:
        flat.copy_(wire)
    else:
        flat = wire
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(reduced)
    return {
        "grad_allreduce_bytes": float(wire.numel() * wire.element_size()),
        "grad_allreduce_seconds": time.perf_counter() - started,
    }
