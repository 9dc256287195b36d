"""The reward plugin: score finished completions."""

from __future__ import annotations

from collections.abc import Sequence

from rollout_sdk.plugin import Plugin
from rollout_sdk.types import Sample

__all__ = ["Reward"]


class Reward(Plugin):
    """Scores a batch of samples; must return exactly one finite float per sample.

    Several rewards combine by the weights given in the run config.
    """

    def score(self, samples: Sequence[Sample]) -> Sequence[float]:
        raise NotImplementedError
