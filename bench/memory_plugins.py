"""A reward for `bench/memory`: a fixed-work training load whatever the model has learnt.

A randomly initialised model never matches an addition answer, so with `ExactMatch` every
group's rewards are equal, every advantage is 0 and (without a KL term) no row is trained.
`CoinFlip` scores each completion 0 or 1 from a hash of its text, so nearly every group has
a spread and every row runs through the backward pass, as in real training.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from rollout_sdk import Reward, Sample

__all__ = ["CoinFlip"]


class CoinFlip(Reward):
    """1.0 or 0.0 from the first byte of the completion's BLAKE2 hash (deterministic)."""

    def score(self, samples: Sequence[Sample]) -> list[float]:
        return [float(hashlib.blake2b(sample.completion.encode()).digest()[0] & 1) for sample in samples]
