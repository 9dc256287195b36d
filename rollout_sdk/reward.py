"""The reward plugin: score finished completions."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar, Literal, get_args

from rollout_sdk.plugin import Plugin
from rollout_sdk.types import Sample

__all__ = ["FailureReason", "Reward", "SampleFailure", "check_score_range"]


#: Why a sample could not be scored (the engine's failure reasons a reward may give).
FailureReason = Literal["raised", "timeout", "crashed", "memory", "invalid"]


@dataclasses.dataclass(frozen=True, slots=True)
class SampleFailure:
    """Returned by :meth:`Reward.score` in place of one sample's score: that sample could not
    be scored (its process broke the reward's harness, its record is unusable...). The sample
    is not trained on, and the failure is counted in the step's metrics (``reward_failed``,
    by reason and by reward) with ``message`` logged; the other samples score as usual."""

    reason: FailureReason
    message: str

    def __post_init__(self) -> None:
        if self.reason not in get_args(FailureReason):
            raise ValueError(f"SampleFailure reason {self.reason!r} is not one of {get_args(FailureReason)}")


class Reward(Plugin):
    """Scores a batch of samples; must return exactly one finite float (or a
    :class:`SampleFailure`) per sample.

    Several rewards combine by the weights given in the run config. ``score_range`` declares the
    scores a reward gives: the engine clamps every score into it, so that no sample, however
    its completion tricks the reward, counts for more than the reward's best (a reward that
    can be gamed to 1e6 would otherwise outweigh a whole step).
    """

    score_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)

    def score(self, samples: Sequence[Sample]) -> Sequence[float | SampleFailure]:
        raise NotImplementedError


def check_score_range(reward: Reward) -> tuple[float, float]:
    """The reward's ``score_range``, checked: two floats, low <= high, neither NaN."""
    try:
        low, high = (float(bound) for bound in reward.score_range)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{type(reward).__name__}.score_range must be (low, high): {err}") from None
    if math.isnan(low) or math.isnan(high) or low > high:
        raise ValueError(f"{type(reward).__name__}.score_range {reward.score_range!r} is not a range")
    return low, high
