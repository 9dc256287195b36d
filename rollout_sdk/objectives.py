"""Reference torch implementations of the training objectives in :mod:`rollout_sdk.types`.

Policy plugins call :func:`objective_loss` with the per-token logprobs of their forward pass so
every model computes GRPO and SFT the same way. Importing this module imports torch.
"""

from __future__ import annotations

import torch

from rollout_sdk.types import GrpoObjective, SftObjective, TrainBatch

__all__ = ["ObjectiveOutput", "objective_loss", "token_logprobs"]


class ObjectiveOutput:
    """The scaled loss to back-propagate and token-mean metrics of the micro-batch."""

    __slots__ = ("loss", "metrics")

    def __init__(self, loss: torch.Tensor, metrics: dict[str, float]) -> None:
        self.loss = loss
        self.metrics = metrics


def objective_loss(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    ref_logprobs: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """Loss for ``batch`` given the policy's per-token ``logprobs`` ``[B, T]`` (column 0 unused).

    GRPO: ``-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`` per token with
    ``r = exp(logprob - old_logprob)``, plus ``kl_coef`` times the k3 estimator of
    KL(policy || reference). SFT: negative log-likelihood. Both are summed over masked tokens
    and multiplied by ``batch.loss_scale``.
    """
    mask = torch.as_tensor(batch.loss_mask, dtype=logprobs.dtype, device=logprobs.device)
    tokens = mask.sum().clamp_min(1.0)
    objective = batch.objective
    if isinstance(objective, SftObjective):
        per_token = -logprobs
        metrics = {"nll": float((per_token.detach() * mask).sum() / tokens)}
    elif isinstance(objective, GrpoObjective):
        old = torch.as_tensor(batch.old_logprobs, dtype=logprobs.dtype, device=logprobs.device)
        advantages = torch.as_tensor(batch.advantages, dtype=logprobs.dtype, device=logprobs.device)
        log_ratio = (logprobs - old) * mask
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - objective.clip_low, 1.0 + objective.clip_high)
        per_token = -torch.minimum(ratio * advantages, clipped * advantages)
        was_clipped = (ratio * advantages > clipped * advantages).to(mask.dtype)
        metrics = {
            "clip_fraction": float((was_clipped * mask).sum() / tokens),
            "ratio_mean": float((ratio.detach() * mask).sum() / tokens),
        }
        if objective.kl_coef > 0.0:
            if ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs reference logprobs")
            delta = (ref_logprobs - logprobs) * mask
            kl = torch.exp(delta) - delta - 1.0
            per_token = per_token + objective.kl_coef * kl
            metrics["kl"] = float((kl.detach() * mask).sum() / tokens)
    else:
        raise TypeError(f"unknown objective {type(objective).__name__}")
    loss = (per_token * mask).sum() * batch.loss_scale
    metrics["loss"] = float((per_token.detach() * mask).sum() / tokens)
    return ObjectiveOutput(loss, metrics)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of each token given the ones before it, aligned with ``input_ids`` ``[B, T]``.

    ``logits[:, t]`` predicts ``input_ids[:, t + 1]``; column 0 of the result is 0.
    """
    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    picked = scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0))
