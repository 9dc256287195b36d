"""Decode attention that reads a prefix shared by several sequences once (cascade attention).

The ``n`` completions of a GRPO prompt are forked from one prefill: their contexts start with
the same cache slots. Gathering each sequence's context separately copies the shared prompt's
keys and values ``n`` times per layer, and at a decode step of a few hundred sequences those
copies, not the weights, are most of the bytes a forward pass moves. Here the sequences of a
step are grouped into *families* with a common leading run of slots; a family's prefix keys
and values are gathered once and all its members' queries are scored against them in one
matrix product, while each sequence's own slots (the rest of its context) are scored
separately. One softmax then runs over the concatenated scores, so the result is ordinary
softmax attention over each sequence's whole context; only the summation order differs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SharedPrefixes", "attend_with_shared_prefixes", "find_shared_prefixes", "plan_tensor"]

# Use the cascade only when it avoids gathering at least this share of the context slots:
# below that, its extra operators cost more than the copies they save.
MIN_SAVING = 0.25


@dataclass(slots=True)
class SharedPrefixes:
    """Families of single-query sequences and the slots each reads, padded into rectangles.

    ``F`` families of up to ``N`` members share up to ``P`` prefix slots; every member has up
    to ``S`` slots of its own after its family's prefix. Members are numbered ``0..B``.
    """

    prefix_slots: torch.Tensor  # [F * P]
    prefix_visible: torch.Tensor  # bool [1, F, 1, P]
    #: Member ``j`` of family ``f`` is sequence ``members[f * N + j]`` (padding repeats a member).
    members: torch.Tensor  # [F * N]
    real_member: torch.Tensor  # bool [1, F * N, 1, 1]
    #: Where each sequence's row is in ``[F * N]``.
    member_row: torch.Tensor  # [B]
    own_slots: torch.Tensor  # [B * S]
    own_visible: torch.Tensor  # bool [1, B, 1, S]
    shape: tuple[int, int, int, int]  # (F, N, P, S)
    gathered: tuple[torch.Tensor, ...] | None = None

    def gather(self, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A layer's prefix keys, prefix values, own keys and own values, each
        ``[kv_heads, slots, dim]``, in buffers allocated once per step and reused by every layer
        (a fresh allocation of this size costs page faults on the host)."""
        kv_heads, head_dim = cache.shape[2:]
        sources = ((cache[0], self.prefix_slots), (cache[1], self.prefix_slots))
        sources += ((cache[0], self.own_slots), (cache[1], self.own_slots))
        if self.gathered is None:
            self.gathered = tuple(cache.new_empty((kv_heads, len(slots), head_dim)) for _, slots in sources)
        for (part, slots), buffer in zip(sources, self.gathered, strict=True):
            if part.device.type == "cpu":
                # On the host, a gather per head from the strided view beats gathering whole
                # slots and transposing them (one pass over the bytes instead of two).
                for head in range(kv_heads):
                    torch.index_select(part[:, head], 0, slots, out=buffer[head])
            else:
                buffer.copy_(part.index_select(0, slots).transpose(0, 1))
        return self.gathered


def plan_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """An attention plan's index (int64) or mask (bool) array on ``device``."""
    dtype = torch.long if array.dtype.kind in "iu" else None
    return torch.tensor(np.ascontiguousarray(array), dtype=dtype, device=device)


def find_shared_prefixes(
    context_slots: np.ndarray, context_lens: np.ndarray, device: torch.device
) -> tuple[np.ndarray, SharedPrefixes] | None:
    """Which of the given single-query sequences to attend as families, and how.

    Returns the positions of the family members among the sequences and their plan. Returns
    ``None`` when no sequences share a prefix, or when families would avoid gathering less
    than ``MIN_SAVING`` of the slots (counted with the padding of each batched call). The
    sequences not in a family are attended the plain way in either case.
    """
    lens = np.asarray(context_lens, dtype=np.int64)
    width = int(lens.max())
    slots = np.asarray(context_slots, dtype=np.int64)[:, :width]
    family, prefix_len = _families(slots, lens)
    in_family = family >= 0
    if not in_family.any():
        return None
    own_lens = lens[in_family] - prefix_len[family[in_family]]
    others = lens[~in_family]
    cascade_slots = len(prefix_len) * int(prefix_len.max()) + len(own_lens) * int(own_lens.max())
    cascade_slots += len(others) * int(others.max(initial=0))
    if cascade_slots > (1 - MIN_SAVING) * len(lens) * width:
        return None
    positions = np.flatnonzero(in_family)
    return positions, _plan(slots[positions], lens[positions], family[positions], prefix_len, device)


def _families(slots: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's family (``-1``: none) and each family's prefix length.

    Sequences with the same first slot are candidates; their prefix is the longest run of
    leading slots all of them have. A sequence's query slot is written by this step only for
    it, so it is never part of a prefix. Families of one member or no common slot are dropped.
    """
    width = slots.shape[1]
    first, head, candidate = np.unique(slots[:, 0], return_index=True, return_inverse=True)
    reference = head[candidate]  # the first sequence of each sequence's candidate family
    column = np.arange(width)
    same = (slots == slots[reference]) & (column < lens[:, None]) & (column < lens[reference, None])
    common = np.where(same.all(axis=1), width, (~same).argmax(axis=1))
    prefix_len = np.full(len(first), width, dtype=np.int64)
    np.minimum.at(prefix_len, candidate, common)
    kept = (np.bincount(candidate, minlength=len(first)) > 1) & (prefix_len > 0)
    renumbered = np.where(kept, np.cumsum(kept) - 1, -1)
    return renumbered[candidate], prefix_len[kept]


def _plan(
    slots: np.ndarray, lens: np.ndarray, family: np.ndarray, prefix_len: np.ndarray, device: torch.device
) -> SharedPrefixes:
    """The padded index tensors for family members (every sequence here has a family)."""
    count, width = slots.shape
    families = len(prefix_len)
    by_family = np.argsort(family, kind="stable")
    rank = np.empty(count, dtype=np.int64)
    rank[by_family] = np.arange(count) - np.searchsorted(family[by_family], family[by_family])
    largest, longest_prefix = int(rank.max()) + 1, int(prefix_len.max())
    first_member = by_family[np.searchsorted(family[by_family], np.arange(families))]
    real = np.zeros((families, largest), dtype=bool)
    real[family, rank] = True
    members = np.repeat(first_member[:, None], largest, axis=1)
    members[family, rank] = np.arange(count)
    own_start = prefix_len[family]
    own_lens = lens - own_start
    longest_own = int(own_lens.max())
    own_index = np.minimum(own_start[:, None] + np.arange(longest_own), width - 1)
    tensor = functools.partial(plan_tensor, device=device)
    return SharedPrefixes(
        prefix_slots=tensor(slots[first_member, :longest_prefix].reshape(-1)),
        prefix_visible=tensor((np.arange(longest_prefix) < prefix_len[:, None])[None, :, None, :]),
        members=tensor(members.reshape(-1)),
        real_member=tensor(real.reshape(1, -1, 1, 1)),
        member_row=tensor(family * largest + rank),
        own_slots=tensor(np.take_along_axis(slots, own_index, axis=1).reshape(-1)),
        own_visible=tensor((np.arange(longest_own) < own_lens[:, None])[None, :, None, :]),
        shape=(families, largest, longest_prefix, longest_own),
    )


def attend_with_shared_prefixes(
    queries: torch.Tensor, cache: torch.Tensor, plan: SharedPrefixes, scale: float
) -> torch.Tensor:
    """Attention of ``B`` single queries ``[B, heads, dim]`` over a layer's cache
    ``[2, slots, kv_heads, dim]``; returns ``[B, heads, dim]``.

    Everything is laid out key/value head first (``[kv_heads, ...]``), so that each product
    is one batched matrix multiply over contiguous operands.
    """
    families, largest, longest_prefix, longest_own = plan.shape
    count, heads, head_dim = queries.shape
    kv_heads = cache.shape[2]
    per_kv = heads // kv_heads
    prefix_k, prefix_v, own_k, own_v = plan.gather(cache)
    grouped = queries.view(count, kv_heads, per_kv, head_dim).transpose(0, 1).contiguous()

    own_scores = torch.bmm(
        grouped.view(kv_heads * count, per_kv, head_dim),
        own_k.view(kv_heads * count, longest_own, head_dim).transpose(1, 2),
    ).view(kv_heads, count, per_kv, longest_own)
    own_scores.mul_(scale).masked_fill_(~plan.own_visible, float("-inf"))
    family_queries = grouped.index_select(1, plan.members)
    prefix_scores = torch.bmm(
        family_queries.view(kv_heads * families, largest * per_kv, head_dim),
        prefix_k.view(kv_heads * families, longest_prefix, head_dim).transpose(1, 2),
    ).view(kv_heads, families, largest * per_kv, longest_prefix)
    prefix_scores.mul_(scale).masked_fill_(~plan.prefix_visible, float("-inf"))
    # Each sequence's scores against its family's prefix, in sequence order.
    member_scores = prefix_scores.view(kv_heads, families * largest, per_kv, longest_prefix)
    prefix_scores = member_scores.index_select(1, plan.member_row)
    weights = torch.cat([prefix_scores, own_scores], dim=-1).softmax(dim=-1, dtype=torch.float32)
    prefix_weights, own_weights = weights.to(queries.dtype).split([longest_prefix, longest_own], dim=-1)

    attended = torch.bmm(
        own_weights.reshape(kv_heads * count, per_kv, longest_own),
        own_v.view(kv_heads * count, longest_own, head_dim),
    ).view(kv_heads, count, per_kv, head_dim)
    # Each member's prefix weights in its family's rows, then one product per family.
    family_weights = prefix_weights.index_select(1, plan.members).mul_(plan.real_member)
    from_prefix = torch.bmm(
        family_weights.view(kv_heads * families, largest * per_kv, longest_prefix),
        prefix_v.view(kv_heads * families, longest_prefix, head_dim),
    ).view(kv_heads, families * largest, per_kv, head_dim)
    attended.index_add_(1, plan.members, from_prefix)
    return attended.transpose(0, 1).reshape(count, heads, head_dim)
