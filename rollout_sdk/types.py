"""Data that crosses the boundary between the `rollout` engine and plugins.

Token ids are ``int64`` and per-token floats ``float32`` NumPy arrays. Batched arrays are
right-padded ``[batch, time]`` and aligned by position: the value at ``[b, t]`` describes token
``input_ids[b, t]`` as predicted from the tokens before it (so column 0 carries no logprob).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = [
    "DpoObjective",
    "FinishReason",
    "Generation",
    "GenerationRequest",
    "GrpoObjective",
    "GspoObjective",
    "Objective",
    "PpoObjective",
    "Sample",
    "SamplingParams",
    "SftObjective",
    "Sharding",
    "TokenBatch",
    "TrainBatch",
]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample one generation call.

    ``logprobs`` returned with a generation are those of the temperature-scaled distribution,
    before top-p/top-k truncation; training uses the same temperature, so they compare exactly.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """One prompt to complete ``n`` times (a GRPO group shares its prompt)."""

    prompt_ids: np.ndarray
    n: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """One completion: the generated ids (including the stop token, if any) and their logprobs."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: FinishReason


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenBatch:
    """Sequences to score with teacher forcing."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    temperature: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpoObjective:
    """Clipped token-level importance-ratio policy gradient (GRPO, Dr. GRPO, RLOO, REINFORCE++).

    With ``kl_coef > 0`` the KL to the reference is a k3 penalty in the loss
    (``kl_penalty="loss"``) or, as REINFORCE++ does, a k1 penalty on each token's reward
    summed to the end of the sequence (``kl_penalty="reward"``).

    ``rollout_correction`` (the same on GSPO and PPO) corrects for the generator's logprobs
    differing from the trainer's (docs/algorithms.md, "Rollout correction"): "none" takes the
    ratio against ``TrainBatch.old_logprobs`` (the generator's); "tis" and "mis" take it against
    the trainer's own logprobs at its first evaluation of the batch and weight each token's
    policy-gradient loss by ``exp(trainer at first evaluation - generator)``, truncated at
    ``rollout_correction_cap`` (TIS) or, outside ``rollout_correction_band``, masked (MIS: the
    token, or with ``rollout_correction_level="sequence"`` the whole sequence by its
    geometric-mean weight).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0
    kl_penalty: Literal["loss", "reward"] = "loss"
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    rollout_correction_cap: float = 2.0
    rollout_correction_band: tuple[float, float] = (0.5, 2.0)
    rollout_correction_level: Literal["token", "sequence"] = "token"


@dataclass(frozen=True, slots=True, kw_only=True)
class GspoObjective:
    """GSPO: the clipped importance ratio is the sequence's, the geometric mean over its tokens."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    kl_coef: float = 0.0
    temperature: float = 1.0
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    rollout_correction_cap: float = 2.0
    rollout_correction_band: tuple[float, float] = (0.5, 2.0)
    rollout_correction_level: Literal["token", "sequence"] = "token"


@dataclass(frozen=True, slots=True, kw_only=True)
class PpoObjective:
    """PPO: GRPO's clipped token ratio on per-token (GAE) advantages, plus the policy's value
    head regressed on ``TrainBatch.returns`` with its change clipped to ``value_clip`` around
    ``TrainBatch.old_values``. With ``train_policy=False`` (critic warm-up) only the value head
    learns. The KL to the reference (``kl_coef > 0``) is a k3 penalty in the loss.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0
    value_clip: float = 0.2
    value_coef: float = 0.5
    train_policy: bool = True
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    rollout_correction_cap: float = 2.0
    rollout_correction_band: tuple[float, float] = (0.5, 2.0)
    rollout_correction_level: Literal["token", "sequence"] = "token"


@dataclass(frozen=True, slots=True, kw_only=True)
class DpoObjective:
    """DPO on pairs of rows: row ``2i`` is pair ``i``'s chosen sequence, ``2i + 1`` its rejected one.

    ``loss_scale`` is ``1 / pairs in the update``.
    """

    beta: float = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class SftObjective:
    """Token-level cross-entropy on the masked tokens."""


Objective = GrpoObjective | GspoObjective | PpoObjective | DpoObjective | SftObjective


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainBatch:
    """One training micro-batch.

    ``loss_scale`` turns the micro-batch's summed token loss into its share of the whole update
    (the engine sets it to ``1 / masked tokens in the update``), so gradient accumulation over
    micro-batches of any shape gives the token-mean loss of the update.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    old_logprobs: np.ndarray
    loss_scale: float
    objective: Objective
    # PPO (else None): value targets and the value head's predictions before the update,
    # per token like ``advantages``.
    returns: np.ndarray | None = None
    old_values: np.ndarray | None = None
    row_staleness: np.ndarray | None = None
    first_logprobs: np.ndarray | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Sharding:
    """How trainer ranks hold the policy (``[train] sharding`` and ``[train.fsdp]``).

    ``mode`` "fsdp" shards parameters, gradients and optimizer state over the trainers'
    process group (FSDP2 ``fully_shard`` per decoder block and at the root). ``param_dtype``
    is the dtype blocks compute in once gathered ("" keeps the parameters' own) and
    ``reduce_dtype`` the dtype gradients are reduced in; ``reshard_after_forward`` frees a
    block's gathered parameters after its forward pass (gathered again for backward);
    ``offload`` keeps the sharded parameters, gradients and optimizer state in CPU memory.
    """

    mode: Literal["replicate", "fsdp"]
    param_dtype: str = ""
    reduce_dtype: str = "float32"
    reshard_after_forward: bool = True
    offload: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """A finished completion, as reward functions see it."""

    prompt: str
    completion: str
    record: Mapping[str, Any] = field(default_factory=dict)
    finish_reason: FinishReason = "stop"
