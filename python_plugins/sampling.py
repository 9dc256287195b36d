"""Choosing the next token from logits: greedy, temperature, top-k and top-p."""

from __future__ import annotations

import torch

from rollout_sdk import SamplingParams

__all__ = ["select_tokens"]


def select_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` ``[rows, vocab]``; return ``(ids, logprobs)``.

    The logprob is that of the temperature-scaled distribution before top-k/top-p truncation
    (temperature 1 when greedy), computed like :func:`rollout_sdk.objectives.token_logprobs`.
    """
    if params.temperature < 0.0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    scaled = logits.float()
    if params.temperature == 0.0:
        ids = scaled.argmax(dim=-1)
    else:
        if params.temperature != 1.0:
            scaled = scaled / params.temperature
        truncated = _truncate(scaled, top_k=params.top_k, top_p=params.top_p)
        probs = torch.softmax(truncated, dim=-1)
        ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    picked = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return ids, picked


def _truncate(scaled: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits outside the top-k tokens and outside the top-p nucleus to -inf."""
    if 0 < top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        outside = mass_before >= top_p
        outside[:, 0] = False
        unsorted = torch.zeros_like(outside).scatter(-1, order, outside)
        scaled = scaled.masked_fill(unsorted, float("-inf"))
    return scaled
