"""Attention over a paged KV cache for unmodified Hugging Face causal LMs.

The sampling engine packs the query tokens of many sequences into one row and says in which
cache slot every key/value lives. :func:`paged_forward` runs a model on such a step: it
switches the model to the ``rollout_paged`` attention function, registered with transformers'
``AttentionInterface``, for the duration of the forward only. That function receives each
layer's queries, keys and values after the position embedding, writes the keys/values into
the cache and attends every sequence to its own context slots.

Transformers builds no attention mask for an implementation it does not know (``masking_utils``
returns ``None`` early), so the only mask is the per-step one built here.
"""

from __future__ import annotations

import functools
import math
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface, PreTrainedConfig, PreTrainedModel

from python_plugins.cascade_attention import (
    SharedPrefixes,
    attend_with_shared_prefixes,
    find_shared_prefixes,
    plan_tensor,
)

__all__ = [
    "ATTENTION_NAME",
    "AttentionPlan",
    "CacheGeometry",
    "PagedKvCache",
    "has_sliding_windows",
    "paged_forward",
]

ATTENTION_NAME = "rollout_paged"


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: PreTrainedConfig) -> CacheGeometry:
        text = config.get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(num_layers=text.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim)

    def elements_per_slot(self) -> int:
        """Cached elements of one token over all layers, keys and values."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def has_sliding_windows(config: PreTrainedConfig) -> bool:
    """Whether any layer may attend over a sliding window: such a model's plans cannot attend
    shared prefixes (``AttentionPlan(shared_prefixes=False)``)."""
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return getattr(text, "sliding_window", None) is not None


class PagedKvCache:
    """Keys and values of ``num_slots`` tokens in every layer: ``[layers, 2, slots, heads, dim]``."""

    def __init__(
        self, geometry: CacheGeometry, num_slots: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        shape = (geometry.num_layers, 2, num_slots, geometry.num_kv_heads, geometry.head_dim)
        if device.type == "cpu":
            # An anonymous mapping: the kernel maps zero pages lazily, so the cache costs
            # resident memory only for the blocks the engine writes (`torch.zeros` touches all
            # of it). Not `np.zeros`: NumPy advises huge pages for large arrays, and where the
            # kernel then compacts memory on every fault, first writes cost several times more.
            mapping = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
            self.kv = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def num_slots(self) -> int:
        return self.kv.shape[2]

    def copy_slots(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """``targets[i]`` receives the keys and values of ``sources[i]`` in every layer.

        All sources are read before any target is written.
        """
        self.kv.index_copy_(2, targets, self.kv.index_select(2, sources))


@dataclass(slots=True)
class _QueryGroup:
    """Sequences attended in one batched call: queries padded to ``Qmax``, contexts to ``L``."""

    query_index: torch.Tensor  # [G * Qmax] packed token of each (sequence, query), padded
    context_slots: torch.Tensor  # [G * L]
    visible: torch.Tensor  # bool [G, 1, Qmax, L]
    #: Context index of every query and every key, for sliding-window layers.
    query_positions: torch.Tensor  # [G, 1, Qmax, 1]
    key_positions: torch.Tensor  # [L]
    #: Which padded queries are real, and which packed tokens they are.
    real_queries: torch.Tensor  # [Tg] indices into G * Qmax
    tokens: torch.Tensor  # [Tg]
    shape: tuple[int, int, int]  # (G, Qmax, L)
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)
    gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def workspace(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers every layer gathers its keys and values into, in turn: allocated once per
        step, not per layer (a fresh allocation of this size costs page faults on the host)."""
        if self.gathered is None:
            shape = (len(self.context_slots), *cache.shape[2:])
            self.gathered = (cache.new_empty(shape), cache.new_empty(shape))
        return self.gathered

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is None:
            return self.visible
        if sliding_window not in self.windowed:
            recent = self.key_positions > self.query_positions - sliding_window
            self.windowed[sliding_window] = self.visible & recent
        return self.windowed[sliding_window]


@dataclass(frozen=True, slots=True)
class _FamilyGroup:
    """Single-query sequences forked from shared prefixes, attended by :mod:`cascade_attention`."""

    tokens: torch.Tensor  # [B] the packed query token of each sequence
    prefixes: SharedPrefixes


class AttentionPlan:
    """Index tensors of one packed forward, built once and shared by all layers.

    Sequence ``s`` owns the packed tokens ``query_start[s]:query_start[s + 1]``, which are the
    last tokens of its context ``context_slots[s, :context_lens[s]]``. Single-token queries
    (decodes) and longer ones (prefill chunks, drafts to verify) are attended in separate
    groups so that a long prefill chunk does not pad every decode to its length. With
    ``shared_prefixes``, decodes whose contexts start with the same slots (the samples of one
    prompt) are attended as families that read their common prefix once.
    """

    def __init__(
        self,
        *,
        slot_mapping: np.ndarray,
        query_start: np.ndarray,
        context_slots: np.ndarray,
        context_lens: np.ndarray,
        device: torch.device,
        shared_prefixes: bool = True,
    ) -> None:
        self.num_tokens = len(slot_mapping)
        self.slot_mapping = torch.tensor(slot_mapping, dtype=torch.long, device=device)
        query_lens = np.diff(query_start)
        single = np.flatnonzero(query_lens == 1)
        self.families: _FamilyGroup | None = None
        if shared_prefixes and len(single) > 1:
            found = find_shared_prefixes(context_slots[single], context_lens[single], device)
            if found is not None:
                positions, prefixes = found
                tokens = torch.tensor(query_start[single[positions]], dtype=torch.long, device=device)
                self.families = _FamilyGroup(tokens, prefixes)
                single = np.delete(single, positions)
        self.groups = [
            _build_group(members, query_start, query_lens, context_slots, context_lens, device)
            for members in (single, np.flatnonzero(query_lens != 1))
            if len(members) > 0
        ]


def _build_group(
    members: np.ndarray,
    query_start: np.ndarray,
    query_lens: np.ndarray,
    context_slots: np.ndarray,
    context_lens: np.ndarray,
    device: torch.device,
) -> _QueryGroup:
    lens = query_lens[members]
    contexts = context_lens[members]
    longest_query, longest_context = int(lens.max()), int(contexts.max())
    offsets = np.arange(longest_query)
    query_index = np.minimum(query_start[members, None] + offsets, query_start[members + 1, None] - 1)
    is_real = offsets < lens[:, None]
    query_positions = (contexts - lens)[:, None] + offsets
    visible = np.arange(longest_context) <= query_positions[:, :, None]

    tensor = functools.partial(plan_tensor, device=device)
    return _QueryGroup(
        query_index=tensor(query_index.reshape(-1)),
        context_slots=tensor(context_slots[members, :longest_context].reshape(-1)),
        visible=tensor(visible[:, None]),
        query_positions=tensor(query_positions[:, None, :, None]),
        key_positions=tensor(np.arange(longest_context)),
        real_queries=tensor(np.flatnonzero(is_real)),
        tokens=tensor(query_index[is_real]),
        shape=(len(members), longest_query, longest_context),
    )


@dataclass(slots=True)
class _ActiveStep:
    cache: PagedKvCache
    plan: AttentionPlan
    layers_run: int = 0


_ACTIVE_STEP: ContextVar[_ActiveStep | None] = ContextVar("rollout_paged_step", default=None)


@contextmanager
def paged_forward(model: PreTrainedModel, cache: PagedKvCache, plan: AttentionPlan) -> Iterator[None]:
    """Within the block, ``model``'s attention reads and writes ``cache`` as ``plan`` says.

    Call the model with the packed tokens as one sequence (``input_ids[None]``,
    ``position_ids=positions[None]``), no attention mask and ``use_cache=False``. Raises if not
    every layer's attention went through the cache: a model whose attention bypasses
    transformers' ``AttentionInterface`` would otherwise attend across the packed sequences.
    """
    # The text decoder's config: other towers of a multimodal model keep their attention.
    config = model.config.get_text_config()
    previous = config._attn_implementation
    active = _ActiveStep(cache, plan)
    token = _ACTIVE_STEP.set(active)
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
        if active.layers_run != cache.kv.shape[0]:
            raise RuntimeError(
                f"only {active.layers_run} of {cache.kv.shape[0]} layers ran `{ATTENTION_NAME}` "
                f"attention: {type(model).__name__} cannot be run by the sampling engine"
            )
    finally:
        config._attn_implementation = previous
        _ACTIVE_STEP.reset(token)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """Write this layer's keys/values to the cache and attend; returns ``[1, T, heads, dim]``.

    ``query`` is ``[1, heads, T, dim]``, ``key``/``value`` ``[1, kv_heads, T, dim]``.
    """
    active = _ACTIVE_STEP.get()
    if active is None:
        raise RuntimeError(f"`{ATTENTION_NAME}` attention runs only inside `paged_forward`")
    if attention_mask is not None:
        raise RuntimeError(f"`{ATTENTION_NAME}` attention got a mask; call the model without one")
    if softcap is not None:
        raise NotImplementedError(f"`{ATTENTION_NAME}` attention does not support logit soft-capping")
    active.layers_run += 1
    cache, plan = active.cache.kv[module.layer_idx], active.plan
    cache[0].index_copy_(0, plan.slot_mapping, key[0].transpose(0, 1))
    cache[1].index_copy_(0, plan.slot_mapping, value[0].transpose(0, 1))

    queries = query[0].transpose(0, 1)  # [T, heads, dim]
    heads, head_dim = queries.shape[1:]
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (packed tokens, their outputs)
    if plan.families is not None:
        if sliding_window is not None:
            raise RuntimeError(
                f"layer {module.layer_idx} attends over a sliding window, which shared-prefix "
                "attention does not support: build the plan with `shared_prefixes=False`"
            )
        scale = scaling if scaling is not None else head_dim**-0.5
        family_queries = queries.index_select(0, plan.families.tokens)
        attended = attend_with_shared_prefixes(family_queries, cache, plan.families.prefixes, scale)
        outputs.append((plan.families.tokens, attended))
    for group in plan.groups:
        outputs.append((group.tokens, _attend_group(group, queries, cache, scaling, sliding_window)))
    if len(outputs) == 1:
        # One group holds every sequence in packed order.
        return outputs[0][1][None], None
    packed = queries.new_empty((plan.num_tokens, heads, head_dim))
    for tokens, output in outputs:
        packed.index_copy_(0, tokens, output)
    return packed[None], None


def _attend_group(
    group: _QueryGroup,
    queries: torch.Tensor,
    cache: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """The outputs ``[Tg, heads, dim]`` of ``group``'s real queries, each sequence attending
    to its own context slots (gathered into the group's reused workspace)."""
    heads, head_dim = queries.shape[1:]
    kv_heads = cache.shape[2]
    sequences, longest_query, longest_context = group.shape
    grouped = queries.index_select(0, group.query_index)
    grouped = grouped.view(sequences, longest_query, heads, head_dim).transpose(1, 2)
    keys, values = (
        torch.index_select(part, 0, group.context_slots, out=gathered)
        .view(sequences, longest_context, kv_heads, head_dim)
        .transpose(1, 2)
        for part, gathered in zip((cache[0], cache[1]), group.workspace(cache), strict=True)
    )
    attended = torch.nn.functional.scaled_dot_product_attention(
        grouped,
        keys,
        values,
        attn_mask=group.mask(sliding_window),
        scale=scaling,
        enable_gqa=kv_heads != heads,
    )
    flat = attended.transpose(1, 2).reshape(sequences * longest_query, heads, head_dim)
    return flat.index_select(0, group.real_queries)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
