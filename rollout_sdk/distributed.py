"""Data-parallel training across trainer processes, on torch.distributed.

The Rust trainer role calls :func:`init_process_group` once (``env://`` rendezvous, as under
``torchrun``: ``MASTER_ADDR`` and ``MASTER_PORT`` name rank 0) and builds one data-parallel
group: a :class:`GradientReducer` for replicated ranks, or a :class:`FullyShardedGroup` over
the modules ``Policy.shard`` sharded. Each update it calls ``before_micro_batch`` ahead of
every micro-batch's ``train_step`` and ``reduce`` after the last one, before
``Policy.apply_update``. Every rank's micro-batch losses are already scaled by the whole
update's token count, so the summed gradients are exactly those of one process training on
every micro-batch.

Before the reduction the engine asks :func:`update_is_finite`: every rank says whether its
losses and gradients are finite and all take the same answer (an all-reduce of one flag), so
a NaN on one rank makes every rank drop the update (:func:`discard_gradients`) rather than
one rank stepping alone, and it never reaches the all-reduce or PowerSGD's error feedback.

Compression runs torch's own DDP communication hooks (``fp16_compress_hook``,
``bf16_compress_hook``, ``powerSGD_hook``) on one flattened bucket of every gradient; the
trainer loop owns the micro-batches, so there is no ``DistributedDataParallel`` wrapper to
register them on.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.tensor import DTensor

from rollout_sdk.types import Sharding

__all__ = [
    "COMPRESSIONS",
    "FlatGradBucket",
    "FullyShardedGroup",
    "GradientReducer",
    "discard_gradients",
    "init_process_group",
    "leave_process_group",
    "update_is_finite",
]

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
_HALF_PRECISION_HOOKS = {
    "fp16": (default_hooks.fp16_compress_hook, torch.float16),
    "bf16": (default_hooks.bf16_compress_hook, torch.bfloat16),
}


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
    if backend == "nccl":
        # NCCL's communicator and barriers use the current device: the parameters' (cuda:0 of
        # the rank's CUDA_VISIBLE_DEVICES when `rollout launch` gave it one GPU), not LOCAL_RANK.
        torch.cuda.set_device(next(p.device for p in parameters if p.device.type == "cuda"))
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_seconds),
    )


def leave_process_group(timeout_seconds: float = 30.0) -> None:
    """Leave the group once every rank has arrived (on gloo, or ``timeout_seconds`` passed).

    Without the barrier, a rank could tear gloo down while a peer's last collective is still
    finishing on gloo's threads, which aborts the process at exit.
    """
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_seconds))
        else:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def update_is_finite(parameters: Sequence[torch.nn.Parameter], locally_finite: bool = True) -> bool:
    """Whether the update about to be applied is finite on every rank of the group.

    This rank's answer is ``locally_finite`` (its losses were) and its own gradients' being
    finite (for sharded parameters, its shard); with a process group joined, every rank must
    call this together, and each gets ``True`` only if every rank's answer was ``True``.
    """
    finite = locally_finite and _gradients_finite(parameters)
    if not (dist.is_available() and dist.is_initialized()):
        return finite
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([1.0 if finite else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0.0)


def _gradients_finite(parameters: Sequence[torch.nn.Parameter]) -> bool:
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if not local:
        return True
    # One fused norm per device: NaN and inf propagate into it (as does a norm too large for
    # float32, which clipping could not use either).
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(local)).item())


def discard_gradients(parameters: Sequence[torch.nn.Parameter]) -> None:
    """Drops the accumulated gradients: an update that is not applied leaves nothing behind."""
    for p in parameters:
        p.grad = None


class FlatGradBucket:
    """The ``dist.GradBucket`` interface over one flattened buffer of gradients.

    torch's communication hooks read a bucket through these methods only; ``gradients()``
    are views into the buffer, as in DDP, so a hook that writes them writes the buffer.
    """

    def __init__(self, buffer: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
        self._buffer = buffer
        self._views = list(_unflatten_dense_tensors(buffer, list(grads)))

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


class GradientReducer:
    """Sums every trainable parameter's gradient over the trainers' group each update.

    ``compression`` "none" all-reduces float32 (exact); "fp16"/"bf16" and "powersgd" run the
    matching torch DDP hook, which averages, so the result is scaled back to the sum.
    PowerSGD (rank ``powersgd_rank`` low-rank factors with error feedback) sends plain
    all-reduces for the first ``powersgd_warmup_updates`` updates, as torch's
    ``start_powerSGD_iter``. Its error-feedback state lives in this object and is not in
    checkpoints: a resumed run starts it afresh.
    """

    def __init__(
        self,
        compression: str = "none",
        powersgd_rank: int = 4,
        powersgd_warmup_updates: int = 10,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown gradient compression {compression!r}; use one of {list(COMPRESSIONS)}")
        self.compression = compression
        self._powersgd = (
            powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=powersgd_warmup_updates,
                min_compression_rate=2,
                use_error_feedback=True,
                warm_start=True,
                random_seed=0,
            )
            if compression == "powersgd"
            else None
        )

    def before_micro_batch(self, last: bool) -> None:
        """Nothing to do: replicated ranks reduce once, in :meth:`reduce`."""

    def reduce(self, parameters: Sequence[torch.nn.Parameter]) -> dict[str, float]:
        """All-reduces the gradients in place (a rank without micro-batches this update
        contributes zeros); returns the bytes this rank sent into the all-reduce and the
        seconds it took."""
        started = time.perf_counter()
        params = [p for p in parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        if self.compression == "none":
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            sent = flat.numel() * flat.element_size()
        else:
            sent = self._run_hook(flat, grads)
            flat.mul_(dist.get_world_size())
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)
        return {
            "grad_allreduce_bytes": float(sent),
            "grad_allreduce_seconds": time.perf_counter() - started,
        }

    def _run_hook(self, flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> int:
        """Averages ``flat`` in place over the group with the configured hook; returns the
        bytes this rank sent."""
        bucket = FlatGradBucket(flat, grads)
        if self._powersgd is None:
            hook, wire = _HALF_PRECISION_HOOKS[self.compression]
            hook(None, bucket).wait()  # type: ignore[arg-type]
            return flat.numel() * wire.itemsize
        state = self._powersgd
        compressed_before = state.total_numel_after_compression
        _run_powersgd_until_released(state, bucket)
        numel = state.total_numel_after_compression - compressed_before or flat.numel()
        return numel * flat.element_size()


def _run_powersgd_until_released(
    state: powerSGD_hook.PowerSGDState, bucket: FlatGradBucket, timeout_seconds: float = 10.0
) -> None:
    """Runs torch's PowerSGD hook and waits until its callbacks have been freed.

    The hook chains its steps with ``Future.then``; gloo runs them on its own threads, which
    free the closures (holding ``state`` and the process group) only after the last future is
    marked done. If the interpreter exits or the group is destroyed before that, gloo's thread
    either drops the group's last reference and joins itself, or takes the GIL during
    finalization; both abort the process.
    """
    references = sys.getrefcount(state)
    powerSGD_hook.powerSGD_hook(state, bucket).wait()  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout_seconds
    while sys.getrefcount(state) > references and time.monotonic() < deadline:
        time.sleep(0.0005)


class FullyShardedGroup:
    """The data-parallel group of FSDP2-sharded ranks.

    ``roots`` are the modules ``Policy.shard`` wrapped with ``fully_shard``. Their gradients
    are reduce-scattered during the backward pass of an update's last micro-batch only
    (earlier ones accumulate unsharded gradients locally) and summed, not averaged, as the
    engine's loss scaling expects. Parameters outside them (PPO's value head) stay
    replicated and are all-reduced in :meth:`reduce`. Every rank must run the same number
    of micro-batches: the engine pads short ranks with passes whose loss scale is 0.
    """

    def __init__(self, roots: Sequence[torch.nn.Module], sharding: Sharding) -> None:
        if not roots:
            raise ValueError("Policy.shard returned no sharded module")
        for root in roots:
            if not hasattr(root, "set_requires_gradient_sync"):
                raise TypeError(f"Policy.shard returned {type(root).__name__}, not a fully_shard module")
            root.set_gradient_divide_factor(1.0)
        self.roots = list(roots)
        self.reduce_dtype = getattr(torch, sharding.reduce_dtype) if sharding.reduce_dtype else None
        self._replicated = GradientReducer()

    def before_micro_batch(self, last: bool) -> None:
        for root in self.roots:
            root.set_requires_gradient_sync(last)

    def reduce(self, parameters: Sequence[torch.nn.Parameter]) -> dict[str, float]:
        """All-reduces the replicated parameters' gradients; returns the bytes this rank sent
        for gradient reduction (its share of the reduce-scatters, plus the all-reduce)."""
        started = time.perf_counter()
        sharded = [p for p in parameters if isinstance(p, DTensor)]
        replicated = [p for p in parameters if not isinstance(p, DTensor) and p.requires_grad]
        sent = 0.0
        if replicated:
            sent += self._replicated.reduce(replicated)["grad_allreduce_bytes"]
        world = dist.get_world_size()
        for param in sharded:
            if param.grad is not None:
                # A ring reduce-scatter sends (world - 1) of every world parts of the buffer.
                itemsize = (self.reduce_dtype or param.dtype).itemsize
                sent += param.numel() * itemsize * (world - 1) / world
        return {"grad_allreduce_bytes": sent, "grad_allreduce_seconds": time.perf_counter() - started}
