"""Reference torch implementations of the training objectives in :mod:`rollout_sdk.types`.

Policy plugins call :func:`objective_loss` with the per-token logprobs of their forward pass
(the reference model's when :func:`needs_reference`, and their value head's predictions when
:func:`needs_values`) so every model computes every objective the same way. Importing this
module imports torch. A new objective is a dataclass in
:mod:`rollout_sdk.types`, a variant of the engine's ``Objective`` and a branch here.

Two guards keep one bad sample from poisoning an update (docs/security.md). Every difference
of logprobs that is exponentiated (the importance ratio, the k3 KL term) is clamped to
``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` first, so ``exp`` stays finite in float32 and
bfloat16 whatever logprobs a sample carries. And a row whose loss is still not finite (a NaN
in its inputs or in the model's forward pass) is left out: the loss is computed again without
it, its index is in :attr:`ObjectiveOutput.excluded_rows`, and the engine counts it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
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

__all__ = [
    "LOG_RATIO_BOUND",
    "MISMATCH_BAND",
    "ObjectiveOutput",
    "first_evaluation_logprobs",
    "mismatch_metrics",
    "needs_reference",
    "needs_values",
    "objective_loss",
    "token_logprobs",
]

PolicyGradient = GrpoObjective | GspoObjective | PpoObjective

#: The largest log-ratio (new minus old logprob, or reference minus policy) exponentiated:
#: ``exp(20)`` is about 4.9e8, far inside float32's and bfloat16's range (both overflow past
#: ``exp(88.7)``) even multiplied by an advantage and summed over a batch. An honest sample's
#: token ratio never comes near it: PPO-style clipping already ignores ratios past ``1 + clip``,
#: and a clamped token contributes no gradient, as a clipped one does.
LOG_RATIO_BOUND = 20.0

#: The per-token ratios ``exp(trainer - generator)`` the mismatch metrics count as close:
#: ``mismatch/ratio_outside_fraction`` is the share of tokens outside it.
MISMATCH_BAND = (0.8, 1.25)


class ObjectiveOutput:
    """The scaled loss to back-propagate and token-mean metrics of the micro-batch, and the
    rows left out of the loss because it was not finite for them."""

    __slots__ = ("excluded_rows", "loss", "metrics", "row_losses")

    def __init__(
        self,
        loss: torch.Tensor,
        metrics: dict[str, float],
        row_losses: torch.Tensor | None = None,
        excluded_rows: list[int] | None = None,
    ) -> None:
        self.loss = loss
        self.metrics = metrics
        #: Each row's share of the loss before scaling ``[B]`` (a DPO pair's on both its rows).
        self.row_losses = row_losses
        self.excluded_rows = excluded_rows or []


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
    sums over pairs. The equations are in docs/algorithms.md. Rows whose loss is not finite
    are left out (``excluded_rows``): the loss and metrics are those of the other rows, still
    scaled by ``batch.loss_scale``, and the excluded rows' gradient is zero wherever the
    model's own forward pass was finite.
    """
    if needs_reference(batch.objective) and ref_logprobs is None:
        raise ValueError(f"{type(batch.objective).__name__} needs reference logprobs")
    output = _objective_loss(logprobs, batch, ref_logprobs, values)
    assert output.row_losses is not None
    bad = ~torch.isfinite(output.row_losses)
    if not bool(bad.any()):
        return output
    if isinstance(batch.objective, DpoObjective):
        bad = _whole_pairs(bad)
    keep = ~bad
    output = _objective_loss(
        _zero_rows(logprobs, bad),
        _without_rows(batch, bad.cpu().numpy()),
        _zero_rows(ref_logprobs, bad),
        _zero_rows(values, bad),
        keep=keep,
    )
    output.excluded_rows = [int(row) for row in torch.nonzero(bad).flatten().tolist()]
    return output


def _objective_loss(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    ref_logprobs: torch.Tensor | None,
    values: torch.Tensor | None,
    keep: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """The loss of ``batch``'s rows, those not in ``keep`` (``[B]`` bool) left out."""
    mask = torch.as_tensor(batch.loss_mask, dtype=logprobs.dtype, device=logprobs.device)
    objective = batch.objective
    if isinstance(objective, DpoObjective):
        return _dpo(logprobs, ref_logprobs, mask, objective, batch.loss_scale, keep)
    if keep is not None:
        mask = mask * keep.to(device=mask.device, dtype=mask.dtype).unsqueeze(1)
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
    if isinstance(objective, PolicyGradient):
        metrics.update(mismatch_metrics(logprobs, batch, mask))
    row_losses = (per_token * mask).sum(dim=1)
    loss = row_losses.sum() * batch.loss_scale
    metrics["loss"] = float(row_losses.detach().sum() / tokens)
    return ObjectiveOutput(loss, metrics, row_losses.detach())


def _zero_rows(tensor: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` with ``rows`` (``[B]`` bool) set to 0: no NaN or inf of theirs reaches the
    loss, and their gradient is zero (``masked_fill`` passes none to the filled entries)."""
    if tensor is None:
        return None
    return tensor.masked_fill(rows.to(tensor.device).unsqueeze(1), 0.0)


def _without_rows(batch: TrainBatch, rows: np.ndarray) -> TrainBatch:
    """``batch`` with ``rows`` out of the loss and their per-token inputs zeroed."""

    def zeroed(array: np.ndarray | None) -> np.ndarray | None:
        if array is None:
            return None
        return np.where(rows[:, None], np.zeros_like(array), array)

    return dataclasses.replace(
        batch,
        loss_mask=zeroed(batch.loss_mask),
        advantages=zeroed(batch.advantages),
        old_logprobs=zeroed(batch.old_logprobs),
        returns=zeroed(batch.returns),
        old_values=zeroed(batch.old_values),
        first_logprobs=zeroed(batch.first_logprobs),
    )


def _whole_pairs(rows: torch.Tensor) -> torch.Tensor:
    """DPO: a pair with either row marked is marked on both rows."""
    pairs = rows[0::2] | rows[1::2]
    return pairs.repeat_interleave(2)[: rows.shape[0]]


def _clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp`` of a log-ratio clamped to ``LOG_RATIO_BOUND`` (no gradient past it)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


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
    weight = None
    if objective.rollout_correction != "none":
        # Decoupled PPO: the clipped ratio is against the trainer's own logprobs at its first
        # evaluation; the generator's enter only through the correction weight.
        trainer_old = _first_logprobs(logprobs, batch)
        weight, correction_metrics = _correction_weights(trainer_old, old, mask, objective)
        metrics.update(correction_metrics)
        old = trainer_old
    log_ratio = (logprobs - old) * mask
    if isinstance(objective, GspoObjective):
        lengths = mask.sum(dim=1, keepdim=True).clamp_min(1.0)
        log_ratio = (log_ratio.sum(dim=1, keepdim=True) / lengths).expand_as(logprobs)
    ratio = _clamped_exp(log_ratio)
    clipped = ratio.clamp(1.0 - objective.clip_low, 1.0 + objective.clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if weight is not None:
        per_token = per_token * weight
    was_clipped = (ratio * advantages > clipped * advantages).to(mask.dtype)
    metrics["clip_fraction"] = float((was_clipped * mask).sum() / tokens)
    metrics["ratio_mean"] = float((ratio.detach() * mask).sum() / tokens)
    if objective.kl_coef > 0.0 and not kl_in_reward:
        assert ref_logprobs is not None
        delta = ((ref_logprobs - logprobs) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + objective.kl_coef * kl
        metrics["kl"] = float((kl.detach() * mask).sum() / tokens)
    return per_token, metrics


def _first_logprobs(logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """The trainer's logprobs at its first evaluation of ``batch``, detached: those the engine
    passes back from the first epoch, else (first epoch) this forward pass's."""
    if batch.first_logprobs is None:
        return logprobs.detach()
    return torch.as_tensor(batch.first_logprobs, dtype=logprobs.dtype, device=logprobs.device)


def first_evaluation_logprobs(logprobs: torch.Tensor, batch: TrainBatch) -> np.ndarray | None:
    """What ``train_step`` returns as ``first_logprobs`` for the engine to pass back in later
    epochs: this forward pass's logprobs when a rollout correction needs them and this is the
    batch's first evaluation, else None."""
    objective = batch.objective
    corrected = isinstance(objective, PolicyGradient) and objective.rollout_correction != "none"
    if not corrected or batch.first_logprobs is not None:
        return None
    return logprobs.detach().float().cpu().numpy()


def _correction_weights(
    trainer_old: torch.Tensor, generator: torch.Tensor, mask: torch.Tensor, objective: PolicyGradient
) -> tuple[torch.Tensor, dict[str, float]]:
    """Each token's detached rollout-correction weight from ``exp(trainer_old - generator)``:
    truncated at the cap (TIS) or 0 outside the band, per token or per sequence (MIS)."""
    tokens = mask.sum().clamp_min(1.0)
    log_weight = ((trainer_old - generator) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    metrics: dict[str, float] = {}
    if objective.rollout_correction == "tis":
        raw = torch.exp(log_weight)
        weight = raw.clamp(max=objective.rollout_correction_cap)
        truncated = (raw > objective.rollout_correction_cap).to(mask.dtype) * mask
        metrics["correction/truncated_fraction"] = float(truncated.sum() / tokens)
    elif objective.rollout_correction == "mis":
        if objective.rollout_correction_level == "sequence":
            lengths = mask.sum(dim=1, keepdim=True).clamp_min(1.0)
            log_weight = (log_weight.sum(dim=1, keepdim=True) / lengths).expand_as(log_weight)
        raw = torch.exp(log_weight)
        low, high = objective.rollout_correction_band
        weight = ((raw >= low) & (raw <= high)).to(mask.dtype)
        metrics["correction/masked_fraction"] = float(((1.0 - weight) * mask).sum() / tokens)
    else:
        raise ValueError(f"unknown rollout_correction {objective.rollout_correction!r}")
    metrics["correction/weight_mean"] = float((weight * mask).sum() / tokens)
    return weight.detach(), metrics


def mismatch_metrics(logprobs: torch.Tensor, batch: TrainBatch, mask: torch.Tensor) -> dict[str, float]:
    """How far the generator's logprobs (``batch.old_logprobs``) are from the trainer's at its
    first evaluation of ``batch``, over the ``mask`` tokens: rows generated with the trained
    weights (``row_staleness`` 0) under ``mismatch/``, older ones under ``stale/``.

    Sums, counts and extremes, so the engine can add them up over micro-batches and trainer
    ranks (keys in docs/config.md): with ``d = trainer - generator`` and ``r = exp(d)``,
    ``tokens``, ``k3_sum`` (``r - 1 - d``, the k3 estimator of KL(generator || trainer)),
    ``ratio_sum``, ``outside_tokens`` (``r`` outside :data:`MISMATCH_BAND`), ``ratio_min`` and
    ``ratio_max``. A family with no token has no key.
    """
    trainer = _first_logprobs(logprobs, batch)
    generator = torch.as_tensor(batch.old_logprobs, dtype=trainer.dtype, device=trainer.device)
    log_ratio = ((trainer - generator) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    k3 = ratio - 1.0 - log_ratio
    low, high = MISMATCH_BAND
    outside = (ratio < low) | (ratio > high)
    stale = np.zeros(mask.shape[0], dtype=bool) if batch.row_staleness is None else batch.row_staleness > 0
    metrics: dict[str, float] = {}
    for family, rows in (("mismatch", ~stale), ("stale", stale)):
        selected = mask.bool() & torch.as_tensor(rows, device=mask.device).unsqueeze(1)
        count = int(selected.sum())
        if count == 0:
            continue
        metrics[f"{family}/tokens"] = float(count)
        metrics[f"{family}/k3_sum"] = float(k3[selected].sum())
        metrics[f"{family}/ratio_sum"] = float(ratio[selected].sum())
        metrics[f"{family}/outside_tokens"] = float(outside[selected].sum())
        metrics[f"{family}/ratio_min"] = float(ratio[selected].min())
        metrics[f"{family}/ratio_max"] = float(ratio[selected].max())
    return metrics


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
    keep: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """``-log sigmoid(beta * (chosen log-ratio - rejected log-ratio))`` per pair of rows; pairs
    with a row outside ``keep`` are left out."""
    assert ref_logprobs is not None
    if logprobs.shape[0] % 2:
        raise ValueError("a DPO micro-batch holds pairs of rows (chosen, rejected)")
    log_ratio = ((logprobs - ref_logprobs.detach()) * mask).sum(dim=1)
    chosen, rejected = log_ratio[0::2], log_ratio[1::2]
    margin = objective.beta * (chosen - rejected)
    per_pair = -torch.nn.functional.logsigmoid(margin)
    kept = torch.ones_like(per_pair) if keep is None else keep[0::2].to(per_pair.device, per_pair.dtype)
    per_pair = per_pair * kept
    pairs = kept.sum().clamp_min(1.0)
    metrics = {
        "loss": float(per_pair.detach().sum() / pairs),
        "reward_accuracy": float(((margin.detach() > 0).to(kept.dtype) * kept).sum() / pairs),
        "reward_margin": float((margin.detach() * kept).sum() / pairs),
        "chosen_reward": float(objective.beta * (chosen.detach() * kept).sum() / pairs),
        "rejected_reward": float(objective.beta * (rejected.detach() * kept).sum() / pairs),
    }
    row_losses = per_pair.detach().repeat_interleave(2)
    return ObjectiveOutput(per_pair.sum() * loss_scale, metrics, row_losses)


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
