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
    "FinishReason",
    "Generation",
    "GenerationRequest",
    "GrpoObjective",
    "Objective",
    "Sample",
    "SamplingParams",
    "SftObjective",
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
    """Clipped importance-ratio policy gradient with an optional k3 KL penalty to a reference."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SftObjective:
    """Token-level cross-entropy on the masked tokens (supervised warm start)."""


Objective = GrpoObjective | SftObjective


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """A finished completion, as reward functions see it."""

    prompt: str
    completion: str
    record: Mapping[str, Any] = field(default_factory=dict)
    finish_reason: FinishReason = "stop"
