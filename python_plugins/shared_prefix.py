"""Teacher-forced logprobs that run each group's shared prompt through the model once.

A GRPO group is ``group_size`` sequences that start with the same prompt. The plain forward
pass computes that prompt once per sequence; here the distinct prompts go through the model
once (with a KV cache that keeps its autograd graph), each sequence's cache rows are selected
from its prompt's, and only the tokens after the prompt are run per sequence. Causal attention
makes the result the same as the plain pass, gradients included: they flow back through the
selected cache into the prompt pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from python_plugins.output_head import OutputHead, predicted_logprobs
from python_plugins.prefix_rows import PrefixRows, plan_prefix_rows, prefix_rows_mask
from python_plugins.suffix_packing import SuffixBins, packed_suffix_mask, plan_suffix_bins
from rollout_sdk.objectives import token_logprobs

__all__ = ["PrefixPlan", "plan_shared_prefixes", "shared_prefix_logprobs"]

# Share only when it saves at least this share of the token positions: two passes cost more
# per-operation overhead than one.
MIN_SAVING = 0.2


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixPlan:
    """How a right-padded ``[rows, width]`` batch splits into shared prefixes and per-row suffixes.

    A row's prefix is every token before its first loss-masked token; rows with identical
    prefixes share one. Prefixes are left-padded to ``[prefixes, prefix_width]`` so that every
    prefix ends in the last column; suffixes are right-padded to ``[rows, suffix_width]``, and
    with ``bins`` run several to a row (:mod:`python_plugins.suffix_packing`).
    """

    prefix_ids: np.ndarray
    prefix_mask: np.ndarray
    row_prefix: np.ndarray
    suffix_ids: np.ndarray
    suffix_mask: np.ndarray
    suffix_positions: np.ndarray
    suffix_start: np.ndarray
    width: int
    bins: SuffixBins | None = None
    one_pass: PrefixRows | None = None

    @property
    def positions(self) -> int:
        """Token positions the two passes compute."""
        if self.one_pass is not None:
            return self.one_pass.size
        suffixes = self.suffix_ids.size if self.bins is None else self.bins.bins * self.bins.capacity
        return self.prefix_ids.size + suffixes


def plan_shared_prefixes(
    input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray, pack_suffixes: bool = False
) -> PrefixPlan | None:
    """The plan for a batch, or ``None`` when sharing saves less than :data:`MIN_SAVING`.

    ``pack_suffixes`` if the model takes a custom 4D mask (:func:`suffix_packing.packs_suffixes`).
    """
    rows, width = input_ids.shape
    lengths = attention_mask.sum(axis=1).astype(np.int64)
    trained = loss_mask > 0
    if not trained.any(axis=1).all():
        return None
    starts = trained.argmax(axis=1)
    if (starts < 1).any():
        return None
    keys: dict[bytes, int] = {}
    row_prefix = np.empty(rows, dtype=np.int64)
    for row in range(rows):
        key = input_ids[row, : starts[row]].tobytes()
        row_prefix[row] = keys.setdefault(key, len(keys))
    prefix_rows = np.array([int(np.argmax(row_prefix == p)) for p in range(len(keys))])
    prefix_lengths = starts[prefix_rows]
    prefix_width = int(prefix_lengths.max())
    suffix_lengths = lengths - starts
    suffix_width = int(suffix_lengths.max())
    bins = plan_suffix_bins(row_prefix, suffix_lengths) if pack_suffixes else None
    suffix_positions = rows * suffix_width if bins is None else bins.bins * bins.capacity
    if len(keys) * prefix_width + suffix_positions > (1.0 - MIN_SAVING) * rows * width:
        return None

    prefix_ids = np.zeros((len(keys), prefix_width), dtype=np.int64)
    prefix_mask = np.zeros((len(keys), prefix_width), dtype=np.int64)
    for prefix, (row, length) in enumerate(zip(prefix_rows, prefix_lengths, strict=True)):
        prefix_ids[prefix, prefix_width - length :] = input_ids[row, :length]
        prefix_mask[prefix, prefix_width - length :] = 1
    columns = np.arange(suffix_width)
    suffix_mask = (columns[None, :] < suffix_lengths[:, None]).astype(np.int64)
    source = np.minimum(starts[:, None] + columns[None, :], width - 1)
    suffix_ids = np.where(suffix_mask > 0, np.take_along_axis(input_ids, source, axis=1), 0)
    one_pass = None
    if pack_suffixes:
        two_passes = len(keys) * prefix_width + suffix_positions
        one_pass = plan_prefix_rows(prefix_ids, prefix_mask, row_prefix, suffix_ids, suffix_mask, two_passes)
        bins = bins if one_pass is None else None
    return PrefixPlan(
        prefix_ids=prefix_ids,
        prefix_mask=prefix_mask,
        row_prefix=row_prefix,
        suffix_ids=suffix_ids,
        suffix_mask=suffix_mask,
        suffix_positions=starts[:, None] + columns[None, :],
        suffix_start=starts,
        width=width,
        bins=bins,
        one_pass=one_pass,
    )


Runner = Callable[..., torch.Tensor]
Tensor = Callable[[np.ndarray], torch.Tensor]


def shared_prefix_logprobs(
    model: PreTrainedModel,
    plan: PrefixPlan,
    temperature: float,
    device: torch.device,
    head: OutputHead | None = None,
) -> torch.Tensor:
    """Per-token logprobs ``[rows, width]`` aligned with the planned batch (0 before each suffix).

    With ``head``, from the decoder's hidden states and the chunked output layer
    (:mod:`python_plugins.output_head`), else from the model's logits.
    """

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(array, device=device)

    def run(**inputs: object) -> torch.Tensor:
        if head is not None:
            return head.hidden(**inputs)
        return model(**inputs).logits

    if plan.one_pass is not None:
        suffix_logprobs = _one_pass(run, head, plan, temperature, tensor)
    else:
        suffix_logprobs = _two_passes(model, run, head, plan, temperature, tensor)
    rows, suffix_width = plan.suffix_ids.shape
    columns = tensor(plan.suffix_start)[:, None] + torch.arange(suffix_width, device=device)[None, :]
    result = suffix_logprobs.new_zeros((rows, plan.width + suffix_width))
    return result.scatter(1, columns, suffix_logprobs)[:, : plan.width]


def _one_pass(
    run: Runner, head: OutputHead | None, plan: PrefixPlan, temperature: float, tensor: Tensor
) -> torch.Tensor:
    """``[rows, suffix_width]`` suffix logprobs from a row per prefix (:mod:`.prefix_rows`)."""
    layout = plan.one_pass
    assert layout is not None
    out = run(
        input_ids=tensor(layout.ids),
        attention_mask=prefix_rows_mask(tensor(layout.segments)),
        position_ids=tensor(layout.positions),
        use_cache=False,
    )
    predicted = tensor(plan.suffix_mask) != 0
    targets = tensor(plan.suffix_ids)[predicted]
    source = tensor(layout.source)
    if head is not None:
        return predicted_logprobs(head, out, source, targets, predicted, temperature)
    logits = out.flatten(0, 1).index_select(0, source).float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return picked.new_zeros(predicted.shape).masked_scatter(predicted, picked)


def _two_passes(
    model: PreTrainedModel,
    run: Runner,
    head: OutputHead | None,
    plan: PrefixPlan,
    temperature: float,
    tensor: Tensor,
) -> torch.Tensor:
    """``[rows, suffix_width]`` suffix logprobs from the prefix pass, then the suffix pass."""
    prefix_mask = tensor(plan.prefix_mask)
    cache = DynamicCache(config=model.config)
    prefix_out = run(
        input_ids=tensor(plan.prefix_ids),
        attention_mask=prefix_mask,
        position_ids=(prefix_mask.cumsum(-1) - 1).clamp_min(0),
        past_key_values=cache,
        use_cache=True,
    )
    row_prefix = tensor(plan.row_prefix)
    suffix_ids = tensor(plan.suffix_ids)
    suffix_mask = tensor(plan.suffix_mask)
    rows, suffix_width = plan.suffix_ids.shape
    bins = plan.bins
    if bins is None:
        cache_rows = row_prefix
        suffix_inputs = {
            "input_ids": suffix_ids,
            "attention_mask": torch.cat([prefix_mask[row_prefix], suffix_mask], dim=1),
            "position_ids": tensor(plan.suffix_positions),
        }
    else:
        lengths = plan.suffix_mask.sum(axis=1)
        cache_rows = tensor(bins.bin_prefix)
        suffix_inputs = {
            "input_ids": tensor(bins.packed(plan.suffix_ids, lengths)),
            "attention_mask": packed_suffix_mask(tensor(bins.segments(lengths)), prefix_mask[cache_rows]),
            "position_ids": tensor(bins.packed(plan.suffix_positions, lengths)),
        }
    # `index_select`, not `batch_select_indices`' advanced indexing: its backward is an
    # `index_add_`, several times faster on CPU than an accumulating `index_put_`.
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, cache_rows)
        layer.values = layer.values.index_select(0, cache_rows)
    suffix_out = run(**suffix_inputs, past_key_values=cache, use_cache=True)
    if bins is not None:
        source = tensor(bins.source(lengths, suffix_width)).view(-1)
        suffix_out = suffix_out.flatten(0, 1).index_select(0, source).view(rows, suffix_width, -1)
    if head is not None:
        # Suffix token `j` follows the prefix's last hidden state (j = 0) or the suffix's `j - 1`.
        hidden = torch.cat([prefix_out[row_prefix, -1:], suffix_out[:, :-1]], dim=1)
        predicted = suffix_mask != 0
        flat_index = torch.arange(rows * suffix_width, device=suffix_ids.device).view(rows, suffix_width)
        return predicted_logprobs(
            head, hidden, flat_index[predicted], suffix_ids[predicted], predicted, temperature
        )
    # The prefix's last position predicts the suffix's first token; each suffix position the next.
    logits = torch.cat([prefix_out[row_prefix, -1:], suffix_out], dim=1)
    targets = torch.cat([suffix_ids[:, :1], suffix_ids], dim=1)
    return token_logprobs(logits, targets, temperature)[:, 1:] * suffix_mask
