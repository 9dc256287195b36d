"""The sampling engine's weight matmuls over few rows, computed weight first.

``nn.Linear`` computes ``x · Wᵀ``. For the few rows of a decode step's tail (the last
sequences of a batch still generating), MKL on AMD EPYC runs that product far below the rate
at which it streams ``W`` from memory, and the same product taken as ``(W · xᵀ)ᵀ`` runs
faster: there (2 threads, the 25M-parameter model of ``bench/engine``) whole engine steps of
2-7 rows took 1.4-1.7x less time, while steps of 8-64 rows were 1-8% slower. MKL on an Intel
Xeon is the other way round: all of that model's matrices at 1-7 rows took 2.5-4.7 ms as
``x · Wᵀ`` and 7.4-8.1 ms weight first (docs/benchmarks.md). One row is multiplied as two,
since MKL's matrix-vector kernel is as slow as the product it replaces.

The choice is a fixed rule per kind of host, not a timing taken at start-up, so that two
runs of one config on one host make the same floating-point roundings (exact resume,
reproducible runs): weight first where torch's BLAS is MKL on an AMD CPU (the case measured
to gain), for at most :data:`WEIGHT_FIRST_MAX_ROWS` rows of a float32 CPU matrix of at least
:data:`WEIGHT_FIRST_MIN_ELEMENTS` elements. Smaller matrices are bound by per-operator cost,
where the extra transposes only add to it. Only inside :func:`engine_forward`: training and
every other forward pass keep ``nn.Linear``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Literal

import torch

__all__ = [
    "WEIGHT_FIRST_MAX_ROWS",
    "WEIGHT_FIRST_MIN_ELEMENTS",
    "EngineMatmuls",
    "cpu_vendor",
    "engine_forward",
    "host_gains_from_weight_first",
    "install_engine_matmuls",
    "weight_first_linear",
]

#: ``auto``: ``weight_first_tail`` on a host that gains from it
#: (:func:`host_gains_from_weight_first`), else ``linear``. ``weight_first_tail``: weight first
#: where the rule above picks it, on any host; ``weight_first`` forces that form on every
#: ``nn.Linear``, ``linear`` never (to compare speed or numerics).
EngineMatmuls = Literal["auto", "linear", "weight_first_tail", "weight_first"]
MODES: tuple[EngineMatmuls, ...] = ("auto", "linear", "weight_first_tail", "weight_first")

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


@functools.cache
def host_gains_from_weight_first() -> bool:
    """Whether torch's BLAS is MKL running on an AMD CPU, where the few-row products of a
    decode step's tail run faster weight first (measured; see the module's docstring)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return cpu_vendor(cpuinfo) == "AuthenticAMD"


def cpu_vendor(cpuinfo: str) -> str | None:
    """The ``vendor_id`` of the first processor in ``/proc/cpuinfo``'s text, if it has one."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return None


def install_engine_matmuls(model: torch.nn.Module, mode: EngineMatmuls) -> int:
    """Make ``model``'s ``nn.Linear`` layers (exactly that class) run weight first inside
    :func:`engine_forward` where ``mode`` says; returns how many layers may."""
    if mode not in MODES:
        raise ValueError(f"engine_matmuls must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        mode = "weight_first_tail" if host_gains_from_weight_first() else "linear"
    if mode == "linear":
        return 0
    tail = mode == "weight_first_tail"
    max_rows = WEIGHT_FIRST_MAX_ROWS if tail else None
    installed = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        if tail and not _large_host_matrix(module.weight):
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
