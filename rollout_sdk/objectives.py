"""Reference torch implementations of the training objectives in :mod:`rollout_sdk.types`.

Policy plugins call :func:`objective_loss` with the per-token logprobs of their forward pass
(the reference model's when :func:`needs_reference`, and their value head's predictions when
:func:`needs_values`) so every model computes every objective the same way. Importing this
module imports torch. A new objective is a dataclass in
:mod:`rollout_sdk.types`, a variant of the engine's ``Objective`` and a branch here.
"""

from __future__ import annotations

import torch

from rollout_sdk.types import (
    DpoObjective,
    GrpoObjective,
    GspoObjective,
    Objective,
    PpoObjective,
    SftObjective,
    TrainBatch,
)

__all__ = ["ObjectiveOutput", "needs_reference", "needs_values", "objective_loss", "token_logprobs"]

PolicyGradient = GrpoObjective | GspoObjective | PpoObjective


class ObjectiveOutput:
    """The scaled loss to back-propagate and token-mean metrics of the micro-batch."""

    __slots__ = ("loss", "metrics")

    def __init__(self, loss: torch.Tensor, metrics: dict[str, float]) -> None:
        self.loss = loss
        self.metrics = metrics


def needs_reference(objective: Objective) -> bool:
    """Whether ``objective_loss`` needs the reference model's logprobs for ``objective``."""
    if isinstance(objective, DpoObjective):
        return True
    return isinstance(objective, PolicyGradient) and objective.kl_coef > 0.0


def needs_values(objective: Objective) -> bool:
    """Whether ``objective_loss`` needs the policy's value-head predictions (PPO)."""
    return isinstance(objective, PpoObjective)


def objective_loss(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    ref_logprobs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """Loss for ``batch`` given the policy's per-token ``logprobs`` ``[B, T]`` (column 0 unused).

    Token objectives are summed over masked tokens and multiplied by ``batch.loss_scale``; DPO
    sums over pairs. The equations are in docs/algorithms.md.
    """
    mask = torch.as_tensor(batch.loss_mask, dtype=logprobs.dtype, device=logprobs.device)
    objective = batch.objective
    if needs_reference(objective) and ref_logprobs is None:
        raise ValueError(f"{type(objective).__name__} needs reference logprobs")
    if isinstance(objective, DpoObjective):
        return _dpo(logprobs, ref_logprobs, mask, objective, batch.loss_scale)
    tokens = mask.sum().clamp_min(1.0)
    if isinstance(objective, SftObjective):
        per_token = -logprobs
        metrics = {"nll": float((per_token.detach() * mask).sum() / tokens)}
    elif isinstance(objective, PpoObjective):
        if values is None:
            raise ValueError("PpoObjective needs the value head's predictions")
        per_token, metrics = _value_loss(values, mask, batch)
        if objective.train_policy:
            policy, policy_metrics = _policy_gradient(logprobs, ref_logprobs, mask, batch)
            per_token = per_token + policy
            metrics.update(policy_metrics)
    elif isinstance(objective, (GrpoObjective, GspoObjective)):
        per_token, metrics = _policy_gradient(logprobs, ref_logprobs, mask, batch)
    else:
        raise TypeError(f"unknown objective {type(objective).__name__}")
    loss = (per_token * mask).sum() * batch.loss_scale
    metrics["loss"] = float((per_token.detach() * mask).sum() / tokens)
    return ObjectiveOutput(loss, metrics)


def _policy_gradient(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, mask: torch.Tensor, batch: TrainBatch
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's clipped token ratio or GSPO's clipped sequence ratio, with the KL penalty."""
    objective = batch.objective
    assert isinstance(objective, PolicyGradient)
    tokens = mask.sum().clamp_min(1.0)
    old = torch.as_tensor(batch.old_logprobs, dtype=logprobs.dtype, device=logprobs.device)
    advantages = torch.as_tensor(batch.advantages, dtype=logprobs.dtype, device=logprobs.device)
    metrics: dict[str, float] = {}
    kl_in_reward = isinstance(objective, GrpoObjective) and objective.kl_penalty == "reward"
    if objective.kl_coef > 0.0 and kl_in_reward:
        assert ref_logprobs is not None
        kl = (old - ref_logprobs.detach()) * mask
        # Each token's return loses the k1 KL of itself and every later token.
        to_go = torch.flip(torch.cumsum(torch.flip(kl, [1]), 1), [1])
        advantages = advantages - objective.kl_coef * to_go * mask
        metrics["kl"] = float(kl.sum() / tokens)
    log_ratio = (logprobs - old) * mask
    if isinstance(objective, GspoObjective):
        lengths = mask.sum(dim=1, keepdim=True).clamp_min(1.0)
        log_ratio = (log_ratio.sum(dim=1, keepdim=True) / lengths).expand_as(logprobs)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - objective.clip_low, 1.0 + objective.clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    was_clipped = (ratio * advantages > clipped * advantages).to(mask.dtype)
    metrics["clip_fraction"] = float((was_clipped * mask).sum() / tokens)
    metrics["ratio_mean"] = float((ratio.detach() * mask).sum() / tokens)
    if objective.kl_coef > 0.0 and not kl_in_reward:
        assert ref_logprobs is not None
        delta = (ref_logprobs - logprobs) * mask
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + objective.kl_coef * kl
        metrics["kl"] = float((kl.detach() * mask).sum() / tokens)
    return per_token, metrics


def _value_loss(
    values: torch.Tensor, mask: torch.Tensor, batch: TrainBatch
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss ``value_coef * 0.5 * max((V - R)^2, (V_clip - R)^2)`` per token."""
    objective = batch.objective
    assert isinstance(objective, PpoObjective)
    if batch.returns is None or batch.old_values is None:
        raise ValueError("a PPO micro-batch carries `returns` and `old_values`")
    tokens = mask.sum().clamp_min(1.0)
    returns = torch.as_tensor(batch.returns, dtype=values.dtype, device=values.device)
    old = torch.as_tensor(batch.old_values, dtype=values.dtype, device=values.device)
    error = (values - returns) ** 2
    if objective.value_clip > 0.0:
        clipped = old + (values - old).clamp(-objective.value_clip, objective.value_clip)
        clipped_error = (clipped - returns) ** 2
        was_clipped = (clipped_error > error).to(mask.dtype) * mask
        metrics = {"value_clip_fraction": float(was_clipped.sum() / tokens)}
        error = torch.maximum(error, clipped_error)
    else:
        metrics = {}
    per_token = objective.value_coef * 0.5 * error
    masked = mask.bool()
    metrics["value_loss"] = float((0.5 * error.detach() * mask).sum() / tokens)
    metrics["value_mean"] = float(values.detach()[masked].mean()) if masked.any() else 0.0
    metrics["returns_mean"] = float(returns[masked].mean()) if masked.any() else 0.0
    return per_token, metrics


def _dpo(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    objective: DpoObjective,
    loss_scale: float,
) -> ObjectiveOutput:
    """``-log sigmoid(beta * (chosen log-ratio - rejected log-ratio))`` per pair of rows."""
    assert ref_logprobs is not None
    if logprobs.shape[0] % 2:
        raise ValueError("a DPO micro-batch holds pairs of rows (chosen, rejected)")
    log_ratio = ((logprobs - ref_logprobs.detach()) * mask).sum(dim=1)
    chosen, rejected = log_ratio[0::2], log_ratio[1::2]
    margin = objective.beta * (chosen - rejected)
    per_pair = -torch.nn.functional.logsigmoid(margin)
    metrics = {
        "loss": float(per_pair.detach().mean()),
        "reward_accuracy": float((margin.detach() > 0).float().mean()),
        "reward_margin": float(margin.detach().mean()),
        "chosen_reward": float(objective.beta * chosen.detach().mean()),
        "rejected_reward": float(objective.beta * rejected.detach().mean()),
    }
    return ObjectiveOutput(per_pair.sum() * loss_scale, metrics)


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
