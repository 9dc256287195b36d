"""The suffix pass of :mod:`python_plugins.shared_prefix` with several suffixes to a row.

A GRPO group's completions share their prompt, so after the prompt pass each completion
(suffix) is run against its prompt's KV cache. Right-padded to the longest completion, most of
that pass is padding when completions differ in length. Here the suffixes of one prefix go
first-fit decreasing into bins as long as the longest suffix; each bin is one row that
continues its prefix's cache, and an explicit 4D mask lets each token see its prefix and,
causally, its own suffix only. Position ids continue each suffix's own prefix, so every token
computes what it would in its own row.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from transformers import PreTrainedConfig

from python_plugins.packing import plan_packing

__all__ = ["MIN_SAVING", "SuffixBins", "packed_suffix_mask", "packs_suffixes", "plan_suffix_bins"]

# Pack only when it saves at least this share of the suffix pass's token positions.
MIN_SAVING = 0.15


@dataclasses.dataclass(frozen=True, slots=True)
class SuffixBins:
    """Bin ``b`` continues prefix ``bin_prefix[b]``; row ``r``'s suffix starts at column
    ``row_offset[r]`` of bin ``row_bin[r]`` of ``[bins, capacity]``."""

    bin_prefix: np.ndarray  # [bins]
    row_bin: np.ndarray  # [rows]
    row_offset: np.ndarray  # [rows]
    capacity: int

    @property
    def bins(self) -> int:
        return len(self.bin_prefix)

    def packed(self, suffix: np.ndarray, lengths: np.ndarray, fill: int = 0) -> np.ndarray:
        """``[bins, capacity]`` from a right-padded ``[rows, width]`` per-suffix array."""
        out = np.full((self.bins, self.capacity), fill, dtype=suffix.dtype)
        for row, length in enumerate(lengths):
            start = self.row_offset[row]
            out[self.row_bin[row], start : start + length] = suffix[row, :length]
        return out

    def source(self, lengths: np.ndarray, width: int) -> np.ndarray:
        """``[rows, width]`` flat packed index of each suffix token (0 past a suffix's end)."""
        columns = np.arange(width)
        index = (self.row_bin * self.capacity + self.row_offset)[:, None] + columns[None, :]
        return np.where(columns[None, :] < lengths[:, None], index, 0)

    def segments(self, lengths: np.ndarray) -> np.ndarray:
        """``[bins, capacity]``: the row whose suffix each position holds, -1 for padding."""
        rows = np.broadcast_to(np.arange(len(lengths))[:, None], (len(lengths), self.capacity))
        return self.packed(np.ascontiguousarray(rows), lengths, fill=-1)


def packs_suffixes(config: PreTrainedConfig) -> bool:
    """Whether the model takes the custom 4D mask as it is: sdpa attention (eager adds masks,
    flash attention takes none), and no sliding-window layers (their window would be dropped)."""
    text = config.get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    return (
        text._attn_implementation == "sdpa"
        and getattr(text, "sliding_window", None) is None
        and layer_types == {"full_attention"}
    )


def plan_suffix_bins(row_prefix: np.ndarray, lengths: np.ndarray) -> SuffixBins | None:
    """Each prefix's suffixes packed into bins of the longest suffix; ``None`` unless that saves
    at least :data:`MIN_SAVING` of the ``rows * longest`` positions."""
    capacity = int(lengths.max())
    row_bin = np.zeros(len(lengths), dtype=np.int64)
    row_offset = np.zeros(len(lengths), dtype=np.int64)
    bin_prefix: list[int] = []
    for prefix in np.unique(row_prefix):
        rows = np.flatnonzero(row_prefix == prefix)
        packing = plan_packing([int(n) for n in lengths[rows]], capacity, min_saving=0.0, capacity=capacity)
        if packing is None:
            return None
        row_bin[rows] = len(bin_prefix) + np.asarray(packing.row_bin)
        row_offset[rows] = packing.row_offset
        bin_prefix += [int(prefix)] * packing.bins
    if len(bin_prefix) * capacity > (1.0 - MIN_SAVING) * len(lengths) * capacity:
        return None
    return SuffixBins(np.asarray(bin_prefix), row_bin, row_offset, capacity)


def packed_suffix_mask(segments: torch.Tensor, prefix_mask: torch.Tensor) -> torch.Tensor:
    """Boolean ``[bins, 1, capacity, prefix_width + capacity]``: each token sees its bin's prefix
    (``prefix_mask`` rows, one per bin) and the tokens of its own suffix up to itself; a padding
    position sees only itself, so that no row of the mask is empty."""
    capacity = segments.shape[1]
    columns = torch.arange(capacity, device=segments.device)
    causal = columns[None, :] <= columns[:, None]
    same = segments[:, :, None] == segments[:, None, :]
    own = same & causal & (segments[:, :, None] >= 0)
    own |= torch.eye(capacity, dtype=torch.bool, device=segments.device)
    prefix = (prefix_mask[:, None, :] != 0) & (segments[:, :, None] >= 0)
    return torch.cat([prefix, own], dim=2)[:, None]
