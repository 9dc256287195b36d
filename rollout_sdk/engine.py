"""The contract between Rollout's sampling engine and a policy's model runner.

The engine (Rust) owns scheduling and the KV cache: every step it decides which sequences
run, which tokens each one feeds, and where in the cache every key/value lives. The policy
only runs the forward pass over the packed tokens and samples from the logits. A policy that
implements :meth:`rollout_sdk.Policy.kv_layout` is run by the engine; otherwise the engine
falls back to the policy's own ``generate``.

The cache is ``num_slots`` token slots per layer; slot ``b * block_size + i`` is token ``i`` of
block ``b``. Sequences of one group share the slots of their prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EngineStep", "EngineStepOutput", "KvLayout"]


@dataclass(frozen=True, slots=True, kw_only=True)
class KvLayout:
    """What the engine needs to size the cache and check requests."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    #: Bytes of one cached key or value element.
    dtype_bytes: int
    #: Longest sequence the model supports (prompt and completion).
    max_positions: int
    #: Memory the cache may use at most on the policy's device, in bytes.
    available_bytes: int

    def bytes_per_slot(self) -> int:
        """Cache bytes of one token across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStep:
    """One forward pass over the scheduled sequences, and what to sample from it.

    Query tokens of all ``S`` scheduled sequences are packed into ``T`` tokens; sequence ``s``
    owns ``input_ids[query_start[s]:query_start[s + 1]]``. Each token's key/value is written
    to ``slot_mapping`` before attention; afterwards sequence ``s`` attends, causally, to the
    slots ``context_slots[s, :context_lens[s]]`` (its whole context including this step's
    tokens, in position order).

    ``R`` output rows say what to sample. Row ``r`` reads the logits of sequence
    ``sample_seq[r]``: for a row without drafts, those of its last query token; a row with
    ``draft_lens[r] = k`` verifies the ``k`` drafted tokens that are the last ``k`` query tokens
    of its sequence and reads the logits of the last ``k + 1``. Several rows may read the same
    sequence (the ``n`` completions of a prompt prefilled once); a row with drafts is the only
    row of its sequence.

    The engine guarantees: positions count from 0 within each sequence; a sequence's query
    tokens occupy the last slots of its context; no slot is written twice in a step; positions
    stay below ``KvLayout.max_positions``.

    A policy with a draft model runs it on every step's known tokens (so its cache, laid out on
    the same slots, never falls behind), and on ``draft_with_model`` steps proposes the drafts
    with ``k + 1`` draft forwards (the last one writes the final draft's key and value).
    """

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    query_start: np.ndarray  # int64 [S + 1]
    context_slots: np.ndarray  # int64 [S, L], padded with 0 beyond context_lens
    context_lens: np.ndarray  # int64 [S]
    sample_seq: np.ndarray  # int64 [R]
    draft_lens: np.ndarray  # int64 [R]
    temperature: np.ndarray  # float32 [R]; 0 is greedy
    top_p: np.ndarray  # float32 [R]
    top_k: np.ndarray  # int64 [R]; 0 disables
    #: Per-row random numbers in [0, 1), derived from each sample's seed and position so that a
    #: sample does not depend on what else is in the batch: ``[R, K + 1, 3]``. For position
    #: ``j`` of a row, ``[r, j, 0]`` decides whether draft ``j`` is accepted, ``[r, j, 1]`` draws
    #: the target's token there and ``[r, j, 2]`` the draft model's proposal.
    uniforms: np.ndarray  # float64 [R, K + 1, 3]
    #: Slot copies done before the forward pass (copy-on-write of a shared, partly filled
    #: block): ``copy_to[i]`` receives ``copy_from[i]``'s key and value in every layer.
    copy_from: np.ndarray  # int64 [C]
    copy_to: np.ndarray  # int64 [C]
    #: The drafts are to be proposed by the policy's draft model: their places in
    #: ``input_ids`` hold -1 (positions and slots are set), and the draft model, whose cache
    #: uses the same slots, fills them in before the target verifies them.
    draft_with_model: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStepOutput:
    """Per row: ``counts[r]`` emitted tokens (accepted drafts, then one sampled token).

    Entries past ``counts[r]`` are 0 (tokens) and 0.0 (logprobs).
    """

    tokens: np.ndarray  # int64 [R, K + 1]
    logprobs: np.ndarray  # float32 [R, K + 1], of the temperature-scaled distribution
    counts: np.ndarray  # int64 [R], 1 <= counts <= draft_lens + 1
    #: Seconds spent inside the model's forward pass (for the engine's overhead metric).
    forward_seconds: float
