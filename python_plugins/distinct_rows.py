"""Rows of a micro-batch that are the same token for token run through the model once.

A group's samples often come out alike when answers are short: every sample that wrote the
same answer to the same prompt is the same row. Such rows compute the same logprobs, so each
distinct row runs once and :meth:`DistinctRows.spread` gives its logprobs to every copy; the
copies' gradients then add up through that gather, which is what running each copy would
have summed. Rows are the same when their tokens, their attention mask and which of their
tokens are trained all match (the trained tokens decide where a shared prompt ends).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = ["DistinctRows", "distinct_rows", "take_distinct"]


@dataclasses.dataclass(frozen=True, slots=True)
class DistinctRows:
    """``first[d]`` is the batch row distinct row ``d`` is taken from (in batch order) and
    ``copy_of[r]`` the distinct row that batch row ``r`` is a copy of."""

    first: np.ndarray
    copy_of: np.ndarray

    def take(self, values: np.ndarray) -> np.ndarray:
        """The distinct rows of a ``[rows, ...]`` array of the batch."""
        return values[self.first]

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """``[distinct rows, ...]`` values back to ``[rows, ...]``, one copy per batch row."""
        return values.index_select(0, torch.as_tensor(self.copy_of, device=values.device))


def distinct_rows(
    input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray
) -> DistinctRows | None:
    """The distinct rows of a ``[rows, width]`` batch, or ``None`` when no two rows are the same."""
    attended = attention_mask != 0
    tokens = np.where(attended, input_ids, 0)
    trained = loss_mask > 0
    seen: dict[tuple[bytes, bytes, bytes], int] = {}
    first: list[int] = []
    copy_of = np.empty(len(input_ids), dtype=np.int64)
    for row in range(len(input_ids)):
        key = (tokens[row].tobytes(), attended[row].tobytes(), trained[row].tobytes())
        copy_of[row] = seen.setdefault(key, len(first))
        if copy_of[row] == len(first):
            first.append(row)
    if len(first) == len(input_ids):
        return None
    return DistinctRows(first=np.asarray(first, dtype=np.int64), copy_of=copy_of)


def take_distinct(found: DistinctRows | None, *arrays: np.ndarray) -> list[np.ndarray]:
    """The distinct rows of each ``[rows, ...]`` array, or the arrays whole without ``found``."""
    return list(arrays) if found is None else [found.take(values) for values in arrays]
