"""The sampling engine's weight matmuls over few rows, computed weight first.

``nn.Linear`` computes ``x · Wᵀ``. For the few rows of a decode step's tail (the last
sequences of a batch still generating), the host's BLAS can run that product far below the
rate at which it streams ``W`` from memory, and the same product taken as ``(W · xᵀ)ᵀ`` runs
faster: with MKL on AMD EPYC (2 threads, the 25M-parameter model of ``bench/engine``), whole
engine steps of 2-7 rows took 1.4-1.7x less time, while steps of 8-64 rows were 1-8% slower
(docs/benchmarks.md). One row is multiplied as two, since MKL's matrix-vector kernel is as
slow as the product it replaces. The choice is a fixed rule, not a timing taken at start-up,
so that two runs of one config on one host make the same floating-point roundings (exact
resume, reproducible runs): weight first for at most :data:`WEIGHT_FIRST_MAX_ROWS` rows of a
float32 CPU matrix (the case measured) of at least :data:`WEIGHT_FIRST_MIN_ELEMENTS`
elements. Smaller matrices are bound by per-operator cost, where the extra transposes only
add to it. Only inside :func:`engine_forward`: training and every other forward pass keep
``nn.Linear``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

import torch

__all__ = [
    "WEIGHT_FIRST_MAX_ROWS",
    "WEIGHT_FIRST_MIN_ELEMENTS",
    "EngineMatmuls",
    "engine_forward",
    "install_engine_matmuls",
    "weight_first_linear",
]

#: ``auto``: ``linear`` everywhere, or weight first where the rule above picks it; the other
#: two force one form on every ``nn.Linear`` (to compare speed or numerics).
EngineMatmuls = Literal["auto", "linear", "weight_first"]

WEIGHT_FIRST_MAX_ROWS = 7
WEIGHT_FIRST_MIN_ELEMENTS = 512 * 512

_IN_ENGINE_FORWARD: ContextVar[bool] = ContextVar("rollout_engine_forward", default=False)


@contextmanager
def engine_forward() -> Iterator[None]:
    """Within the block, the linear layers :func:`install_engine_matmuls` chose run weight first."""
    token = _IN_ENGINE_FORWARD.set(True)
    try:
        yield
    finally:
        _IN_ENGINE_FORWARD.reset(token)


def weight_first_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as ``(weight · xᵀ)ᵀ``, contiguous; a single row is doubled."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count == 1:
        rows = torch.cat((rows, rows))
    if bias is None:
        product = torch.mm(weight, rows.t())
    else:
        product = torch.addmm(bias[:, None], weight, rows.t())
    return product.t()[:count].contiguous().view(*x.shape[:-1], weight.shape[0])


def install_engine_matmuls(model: torch.nn.Module, mode: EngineMatmuls) -> int:
    """Make ``model``'s ``nn.Linear`` layers (exactly that class) run weight first inside
    :func:`engine_forward` where ``mode`` says; returns how many layers may."""
    if mode not in ("auto", "linear", "weight_first"):
        raise ValueError(f"engine_matmuls must be auto, linear or weight_first, got {mode!r}")
    if mode == "linear":
        return 0
    max_rows = WEIGHT_FIRST_MAX_ROWS if mode == "auto" else None
    installed = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        if mode == "auto" and not _large_host_matrix(module.weight):
            continue
        module.forward = functools.partial(_forward, module, max_rows)
        installed += 1
    return installed


def _large_host_matrix(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.numel() >= WEIGHT_FIRST_MIN_ELEMENTS
    )


def _forward(module: torch.nn.Linear, max_rows: int | None, x: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if (
        _IN_ENGINE_FORWARD.get()
        and weight.device.type == "cpu"
        and (max_rows is None or x.numel() <= max_rows * x.shape[-1])
    ):
        return weight_first_linear(x, weight, module.bias)
    return torch.nn.functional.linear(x, weight, module.bias)
