"""Packing a right-padded micro-batch's rows into fewer rows without padding between them.

Each packed row (a bin) holds whole sequences one after another, their position ids each
restarting at 0; transformers' attention masks (``find_packed_sequence_indices`` in
``masking_utils``, used when the forward pass gets position ids and no attention mask) then keep
every sequence to itself, causally. Bins are as wide as the longest row, so attention never
spans more positions than in the padded batch; what is left at the end of a bin is padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["MIN_SAVING", "Packing", "plan_packing", "plan_right_padded"]

# Pack only when it saves at least this share of the token positions.
MIN_SAVING = 0.15


@dataclasses.dataclass(frozen=True, slots=True)
class Packing:
    """Row ``r`` of the padded batch is at ``row_offset[r]`` in bin ``row_bin[r]`` of ``[bins, capacity]``."""

    bins: int
    capacity: int
    row_bin: list[int]
    row_offset: list[int]

    @property
    def positions(self) -> int:
        return self.bins * self.capacity

    def layout(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, pad_id: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed ``input_ids`` and ``position_ids`` ``[bins, capacity]``, and the flat packed index
        of every real token of the padded ``input_ids`` (row-major order of ``(row, column)``)."""
        rows, width = input_ids.shape
        device = input_ids.device
        columns = torch.arange(width, device=device)
        real = columns[None, :] < lengths[:, None]
        start = torch.tensor(self.row_bin, device=device) * self.capacity + torch.tensor(
            self.row_offset, device=device
        )
        destination = (start[:, None] + columns[None, :])[real]
        packed_ids = input_ids.new_full((self.positions,), pad_id)
        packed_ids[destination] = input_ids[real]
        # Padding at a bin's end counts on from 0 too: a sequence of its own.
        tail = torch.ones(self.positions, dtype=torch.bool, device=device)
        tail[destination] = False
        positions = _tail_positions(tail, self.capacity)
        positions[destination] = columns.expand(rows, width)[real]
        return packed_ids.view(self.bins, -1), positions.view(self.bins, -1), destination


def _tail_positions(tail: torch.Tensor, capacity: int) -> torch.Tensor:
    """0, 1, ... counting from the first padding position of each bin."""
    bins = tail.view(-1, capacity)
    first = capacity - bins.sum(dim=1, keepdim=True)
    return (torch.arange(capacity, device=tail.device)[None, :] - first).clamp_min(0).view(-1)


def plan_packing(
    lengths: Sequence[int], width: int, min_saving: float = MIN_SAVING, capacity: int | None = None
) -> Packing | None:
    """First-fit decreasing into bins of ``capacity`` (default: the longest row's length);
    ``None`` unless it saves at least ``min_saving`` of the ``rows * width`` positions."""
    if not lengths or min(lengths) < 1:
        return None
    capacity = max(lengths) if capacity is None else max(capacity, max(lengths))
    free: list[int] = []
    row_bin = [0] * len(lengths)
    row_offset = [0] * len(lengths)
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        length = lengths[row]
        target = next((b for b, room in enumerate(free) if room >= length), len(free))
        if target == len(free):
            free.append(capacity)
        row_bin[row] = target
        row_offset[row] = capacity - free[target]
        free[target] -= length
    packing = Packing(bins=len(free), capacity=capacity, row_bin=row_bin, row_offset=row_offset)
    if packing.positions > (1.0 - min_saving) * len(lengths) * width:
        return None
    return packing


def plan_right_padded(attention_mask: np.ndarray, min_saving: float = MIN_SAVING) -> Packing | None:
    """:func:`plan_packing` of the inputs of a ``[rows, width]`` mask's rows: each row's tokens
    but its last, which predicts nothing. ``None`` unless every row is right-padded."""
    width = attention_mask.shape[1]
    lengths = (attention_mask != 0).sum(axis=1)
    if not ((attention_mask != 0) == (np.arange(width)[None, :] < lengths[:, None])).all():
        return None
    return plan_packing([int(n) - 1 for n in lengths], width, min_saving)
