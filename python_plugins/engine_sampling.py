"""Sampling and speculative verification for the sampling engine, vectorised over rows.

Every row carries its own temperature, top-k and top-p, and its own uniforms: a token is drawn
by inversion of the (truncated) distribution's CDF at the row's uniform, so it depends only on
the logits and that number, never on the other rows of the batch. Truncation follows
:mod:`python_plugins.sampling` (top-k, then top-p on the renormalised rest; ties with the k-th
logit are kept), and logprobs are those of the temperature-scaled distribution before
truncation (temperature 1 for greedy rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["RowSampling", "propose", "sampling_probs", "verify"]


@dataclass(frozen=True, slots=True)
class RowSampling:
    """Per-row settings on the logits' device, with host-side flags that spare a sync."""

    temperature: torch.Tensor  # float32 [R]; 0 is greedy
    top_p: torch.Tensor  # float32 [R]
    top_k: torch.Tensor  # int64 [R]; 0 disables
    largest_top_k: int
    any_top_p: bool

    @classmethod
    def of(
        cls, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray, device: torch.device
    ) -> RowSampling:
        sampled = temperature > 0
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            largest_top_k=int(top_k[sampled].max(initial=0)),
            any_top_p=bool((top_p[sampled] < 1.0).any()),
        )

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0

    def select(self, rows: torch.Tensor) -> RowSampling:
        return RowSampling(
            temperature=self.temperature[rows],
            top_p=self.top_p[rows],
            top_k=self.top_k[rows],
            largest_top_k=self.largest_top_k,
            any_top_p=self.any_top_p,
        )

    def repeat_each(self, times: int) -> RowSampling:
        """The settings of ``times`` consecutive rows per row (for ``[R, times, V]`` logits)."""
        return RowSampling(
            temperature=self.temperature.repeat_interleave(times),
            top_p=self.top_p.repeat_interleave(times),
            top_k=self.top_k.repeat_interleave(times),
            largest_top_k=self.largest_top_k,
            any_top_p=self.any_top_p,
        )


def scaled_logits(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """``logits [N, V]`` as float32, divided by each row's temperature (1 for greedy rows)."""
    temperature = torch.where(sampling.greedy, 1.0, sampling.temperature)
    return logits.float() / temperature[:, None]


def sampling_probs(scaled: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """The distribution each row samples from: softmax of ``scaled`` after top-k and top-p."""
    vocab = scaled.shape[-1]
    if 0 < sampling.largest_top_k:
        limited = (sampling.top_k > 0) & (sampling.top_k < vocab)
        top_k = torch.where(limited, sampling.top_k, 1)
        largest = torch.topk(scaled, min(sampling.largest_top_k, vocab), dim=-1).values
        kth_largest = largest.gather(-1, (top_k - 1)[:, None].clamp_max(largest.shape[-1] - 1))
        kth_largest = torch.where(limited[:, None], kth_largest, float("-inf"))
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.any_top_p:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        outside = (mass_before >= sampling.top_p[:, None]) & (sampling.top_p < 1.0)[:, None]
        outside[:, 0] = False
        probs = probs.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _invert_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative ``weights [N, V]``, the token where the normalised CDF passes ``u``."""
    cdf = weights.cumsum(dim=-1)
    thresholds = uniforms.to(cdf.dtype) * cdf[:, -1]
    picked = torch.searchsorted(cdf, thresholds[:, None], right=True).squeeze(-1)
    # Rounding can put the threshold at the total mass: fall back to the last possible token.
    last_possible = weights.shape[-1] - 1 - (weights > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(picked, last_possible)


def propose(
    logits: torch.Tensor, sampling: RowSampling, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft model's proposal per row of ``logits [N, V]``: ``(tokens, probs it drew from)``.

    Greedy rows take the argmax (their probs are not used: greedy verification compares tokens).
    """
    probs = sampling_probs(scaled_logits(logits, sampling), sampling)
    tokens = torch.where(sampling.greedy, logits.argmax(dim=-1), _invert_cdf(probs, uniforms))
    return tokens, probs


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor,
    sampling: RowSampling,
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and sample the next token; ``(tokens, logprobs, counts)``.

    ``logits [R, K + 1, V]`` are the target's at the row's last ``draft_lens[r] + 1`` query
    tokens, ``drafts [R, K]`` the drafted tokens (beyond ``draft_lens`` ignored), ``uniforms
    [R, K + 1, 3]`` as in :class:`rollout_sdk.EngineStep`. ``draft_probs [R, K, V]`` is the
    distribution each draft was drawn from; ``None`` means deterministic drafts (a point mass).

    Greedy rows accept drafts equal to the argmax and then emit the argmax, exactly as
    decoding without drafts would. Sampled rows use speculative rejection sampling: draft
    ``j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first
    rejection the token is drawn from ``max(0, p_j - q_j)`` renormalised, and after ``k``
    acceptances from ``p_k``, so emitted tokens follow the target distribution ``p``.
    """
    rows, positions, vocab = logits.shape
    max_drafts = positions - 1
    flat_sampling = sampling.repeat_each(positions)
    scaled = scaled_logits(logits.reshape(rows * positions, vocab), flat_sampling)
    logprobs = torch.log_softmax(scaled, dim=-1).view(rows, positions, vocab)
    probs = sampling_probs(scaled, flat_sampling).view(rows, positions, vocab)
    best = logits.argmax(dim=-1)
    row = torch.arange(rows, device=logits.device)

    drafted = torch.arange(max_drafts, device=logits.device) < draft_lens[:, None]
    target_at_draft = probs[:, :max_drafts].gather(-1, drafts[..., None]).squeeze(-1)
    if draft_probs is None:
        proposal_at_draft = torch.ones_like(target_at_draft)
    else:
        proposal_at_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    sampled_accepts = uniforms[:, :max_drafts, 0].to(probs.dtype) * proposal_at_draft < target_at_draft
    accepts = torch.where(sampling.greedy[:, None], drafts == best[:, :max_drafts], sampled_accepts)
    accepted = (accepts & drafted).long().cumprod(dim=-1).sum(dim=-1)

    # The proposal at the rejected draft, to remove from the target (zero where none was).
    rejected_proposal = torch.zeros_like(probs[:, 0])
    if max_drafts > 0:
        at = accepted.clamp_max(max_drafts - 1)
        if draft_probs is None:
            rejected_proposal[row, drafts[row, at]] = 1.0
        else:
            rejected_proposal = draft_probs[row, at].clone()
        rejected_proposal *= (accepted < draft_lens)[:, None]
    target = probs[row, accepted]
    residual = (target - rejected_proposal).clamp_min(0.0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target)
    sampled = _invert_cdf(residual, uniforms[row, accepted, 1])
    final = torch.where(sampling.greedy, best[row, accepted], sampled)

    tokens = torch.cat([drafts, final[:, None]], dim=1)
    tokens[row, accepted] = final
    emitted = torch.arange(positions, device=logits.device) <= accepted[:, None]
    tokens = torch.where(emitted, tokens, 0)
    token_logprobs = torch.where(emitted, logprobs.gather(-1, tokens[..., None]).squeeze(-1), 0.0)
    return tokens, token_logprobs, accepted + 1
