"""Shared prompts in one pass: a row per prompt, holding the prompt and then its completions.

:mod:`python_plugins.shared_prefix` runs the distinct prompts, then the completions against
their cache: two forward and two backward passes, each streaming every weight and gradient
through memory. When completions are short that streaming, not arithmetic, is the training
step's cost, so here each prompt and its completions share one row and a 4D mask shows each
completion token its prompt and its own completion only (the prompt attends causally to
itself). Every completion's positions continue from its prompt's end, so every token computes
what it would in its own padded row. A completion's last token is left out: it predicts
nothing, and no other token sees it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = ["MAX_WIDTH", "PrefixRows", "plan_prefix_rows", "prefix_rows_mask"]

# Rows at most this wide: attention over a row grows with its square, and the rows' completions
# do not attend to each other, so wider rows would pay for pairs that are masked out.
MAX_WIDTH = 512
# One pass for at most this many times the token positions of the two passes.
MAX_EXTRA_POSITIONS = 2.0

PROMPT = -1
PADDING = -2


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixRows:
    """``[prefixes, width]`` rows: ``ids``, ``positions``, and in ``segments`` the batch row of
    each completion token (:data:`PROMPT` for the prompt, :data:`PADDING` after the row's end).
    ``source`` is, for every completion token of the batch (row-major over ``[rows,
    suffix_width]``, where ``suffix_mask`` is set), the flat index of the position that
    predicts it: the prompt's last for a completion's first token, else the one before."""

    ids: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    source: np.ndarray

    @property
    def size(self) -> int:
        return self.ids.size


def plan_prefix_rows(
    prefix_ids: np.ndarray,
    prefix_mask: np.ndarray,
    row_prefix: np.ndarray,
    suffix_ids: np.ndarray,
    suffix_mask: np.ndarray,
    two_pass_positions: int,
) -> PrefixRows | None:
    """The one-pass layout of a shared-prefix plan's pieces (left-padded prefixes, right-padded
    suffixes), or ``None`` when its rows would be wider than :data:`MAX_WIDTH` or it computes
    more than :data:`MAX_EXTRA_POSITIONS` times the two passes' positions."""
    prefix_lengths = prefix_mask.sum(axis=1)
    suffix_lengths = suffix_mask.sum(axis=1)
    # Every suffix has a token (the planner's rows each train one); all but its last are inputs.
    inputs = suffix_lengths - 1
    row_widths = prefix_lengths + np.bincount(row_prefix, weights=inputs, minlength=len(prefix_ids))
    width = int(row_widths.max())
    if width > MAX_WIDTH or len(prefix_ids) * width > MAX_EXTRA_POSITIONS * two_pass_positions:
        return None
    ids = np.zeros((len(prefix_ids), width), dtype=np.int64)
    positions = np.zeros_like(ids)
    segments = np.full_like(ids, PADDING)
    for prefix, length in enumerate(prefix_lengths):
        ids[prefix, :length] = prefix_ids[prefix, prefix_ids.shape[1] - length :]
        positions[prefix, :length] = np.arange(length)
        segments[prefix, :length] = PROMPT
    filled = prefix_lengths.copy()
    sources = []
    for row, (prefix, fed) in enumerate(zip(row_prefix, inputs, strict=True)):
        start = filled[prefix]
        ids[prefix, start : start + fed] = suffix_ids[row, :fed]
        positions[prefix, start : start + fed] = prefix_lengths[prefix] + np.arange(fed)
        segments[prefix, start : start + fed] = row
        before = np.concatenate([[prefix_lengths[prefix] - 1], start + np.arange(fed)])
        sources.append(prefix * width + before)
        filled[prefix] += fed
    return PrefixRows(ids, positions, segments, np.concatenate(sources))


def prefix_rows_mask(segments: torch.Tensor) -> torch.Tensor:
    """Boolean ``[prefixes, 1, width, width]``: a position sees the prompt and its own
    completion up to itself; padding sees only itself, so that no row of the mask is empty."""
    width = segments.shape[1]
    columns = torch.arange(width, device=segments.device)
    causal = columns[None, :] <= columns[:, None]
    query, key = segments[:, :, None], segments[:, None, :]
    visible = causal & ((key == PROMPT) | ((key == query) & (query >= 0)))
    visible &= query != PADDING
    visible |= torch.eye(width, dtype=torch.bool, device=segments.device)
    return visible[:, None]
