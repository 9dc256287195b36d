"""Per-token logprobs from last hidden states and an output layer, without ``[tokens, vocab]`` logits.

:func:`chunked_logprobs` gives, row for row, what ``log_softmax(linear(hidden) / T)`` picks for
each target, as :func:`rollout_sdk.objectives.token_logprobs` does on a model's full logits: the
logits of a chunk of rows are computed in the weight's dtype and then in float32, like the
model's logits followed by ``.float()``. Only one chunk's logits exist at a time, in the forward
pass and again in the backward pass, which recomputes them instead of saving them. Importing
this module imports torch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CHUNK_BYTES", "chunk_rows", "chunked_logprobs"]

# The float32 logits of one chunk take at most this many bytes (unless one row needs more).
CHUNK_BYTES = 64 * 2**20


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: as many as keep ``rows * vocab_size`` float32 logits within ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * max(vocab_size, 1)))


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk: int | None = None,
) -> torch.Tensor:
    """Float32 logprob ``[N]`` of ``targets [N]`` under ``softmax((hidden @ weight.T + bias) / T)``.

    ``hidden`` is ``[N, H]`` (after the model's final norm), ``weight`` the output layer's
    ``[V, H]``. ``chunk`` rows at a time (default :func:`chunk_rows`). Differentiable in
    ``hidden``, ``weight`` and ``bias`` (each only if it requires grad).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        shapes = f"{list(hidden.shape)} and {list(targets.shape)}"
        raise ValueError(f"expected hidden [N, H] and targets [N], got {shapes}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    rows = chunk if chunk is not None else chunk_rows(weight.shape[0])
    if rows < 1:
        raise ValueError(f"chunk must be at least 1, got {rows}")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    if not needs_grad:
        return _forward(hidden, weight, bias, targets, temperature, rows)[0]
    return _ChunkedLogprobs.apply(hidden, weight, bias, targets, temperature, rows)


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return logits / temperature if temperature != 1.0 else logits


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logprobs and each row's float32 log-sum-exp of the scaled logits."""
    count = hidden.shape[0]
    picked = torch.empty(count, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(count, dtype=torch.float32, device=hidden.device)
    for start in range(0, count, rows):
        end = min(start + rows, count)
        logits = _scaled_logits(hidden[start:end], weight, bias, temperature)
        lse[start:end] = torch.logsumexp(logits, dim=-1)
        picked[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - lse[start:end]
    return picked, lse


class _ChunkedLogprobs(torch.autograd.Function):
    """Saves only the inputs and ``[N]`` log-sum-exps; backward recomputes each chunk's logits.

    With ``g`` the incoming gradient of a row and ``p`` its softmax, the gradient of the row's
    float32 logits is ``(onehot(target) - p) * g / T``; cast to the weight's dtype (as the
    backward of ``.float()`` does), it gives ``grad_hidden = grad_logits @ W``,
    ``grad_W += grad_logits.T @ hidden`` and ``grad_bias += grad_logits.sum(0)``, accumulated
    over chunks in the weight's dtype.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        rows: int,
    ) -> torch.Tensor:
        picked, lse = _forward(hidden, weight, bias, targets, temperature, rows)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature = temperature
        ctx.rows = rows
        return picked

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        temperature, rows = ctx.temperature, ctx.rows
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight) if needs_weight else None
        grad_bias = torch.zeros_like(bias) if needs_bias and bias is not None else None
        grad_output = grad_output.float() / temperature
        for start in range(0, hidden.shape[0], rows):
            end = min(start + rows, hidden.shape[0])
            chunk = hidden[start:end]
            # -softmax * g / T, plus g / T at each row's target: in place in one buffer.
            grad_logits = _scaled_logits(chunk, weight, bias, temperature)
            grad_logits.sub_(lse[start:end, None]).exp_().mul_(-grad_output[start:end, None])
            grad_logits.scatter_add_(-1, targets[start:end, None], grad_output[start:end, None])
            grad_logits = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), chunk.to(weight.dtype))
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(0))
        return grad_hidden, grad_weight, grad_bias, None, None, None
