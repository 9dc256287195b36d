"""Checking an :class:`rollout_sdk.EngineStep` and deriving the indices the runner needs.

A wrong slot or length from the scheduler would otherwise read another sequence's cache, or
index out of bounds on the device (a CUDA assert rather than an error), so everything is
checked on the host first, with messages that name the field and the offending entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rollout_sdk import EngineStep

__all__ = ["StepLayout", "check_step"]


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Indices derived from a valid step (``S`` sequences, ``R`` rows, up to ``K`` drafts)."""

    query_lens: np.ndarray  # [S]
    #: Drafts at the end of each sequence's query tokens (0 for sequences without).
    sequence_draft_lens: np.ndarray  # [S]
    #: Packed token whose logits row ``r`` reads at position ``j``; the last one repeated
    #: beyond ``draft_lens[r]``.
    logit_tokens: np.ndarray  # [R, K + 1]
    #: Packed token of draft ``j`` of row ``r``; the last query token beyond ``draft_lens[r]``.
    draft_tokens: np.ndarray  # [R, K]

    @property
    def max_drafts(self) -> int:
        return self.draft_tokens.shape[1]


def check_step(
    step: EngineStep, *, num_slots: int, vocab_size: int, max_positions: int, has_draft_model: bool
) -> StepLayout:
    """Raise ``ValueError`` naming the first inconsistency of ``step``; else its layout."""
    input_ids = _ints("input_ids", step.input_ids, 1)
    queries = _check_queries(step, len(input_ids), num_slots, max_positions)
    sample_seq, draft_lens, max_drafts = _check_rows(step, queries.lens)

    drafting = draft_lens > 0
    sequence_draft_lens = np.zeros(len(queries.lens), dtype=np.int64)
    sequence_draft_lens[sample_seq[drafting]] = draft_lens[drafting]
    first_draft = queries.context_lens - sequence_draft_lens
    is_draft = queries.context_index >= first_draft[queries.sequence_of_token]
    _check_input_ids(input_ids, is_draft, vocab_size, step.draft_with_model, has_draft_model)

    query_end = queries.start[sample_seq + 1]
    offsets = np.arange(max_drafts + 1)
    first_read = (query_end - draft_lens - 1)[:, None]
    return StepLayout(
        query_lens=queries.lens,
        sequence_draft_lens=sequence_draft_lens,
        logit_tokens=first_read + np.minimum(offsets, draft_lens[:, None]),
        draft_tokens=np.minimum(first_read + 1 + offsets[:max_drafts], query_end[:, None] - 1),
    )


class _Queries(NamedTuple):
    """A checked step's query tokens: per sequence, and where each token sits in its context."""

    start: np.ndarray  # [S + 1]
    lens: np.ndarray  # [S]
    context_lens: np.ndarray  # [S]
    sequence_of_token: np.ndarray  # [T]
    context_index: np.ndarray  # [T]


def _check_queries(step: EngineStep, tokens: int, num_slots: int, max_positions: int) -> _Queries:
    """The sequences' queries, contexts, positions and slots (and the slot copies)."""
    query_start = _ints("query_start", step.query_start, 1)
    if tokens == 0 or len(query_start) < 2 or query_start[0] != 0 or query_start[-1] != tokens:
        raise ValueError(
            f"engine step: query_start must run from 0 to the number of query tokens ({tokens}), "
            f"got {query_start.tolist()}"
        )
    sequences = len(query_start) - 1
    positions = _ints("positions", step.positions, 1, tokens)
    slot_mapping = _ints("slot_mapping", step.slot_mapping, 1, tokens)
    context_slots = _ints("context_slots", step.context_slots, 2, sequences)
    context_lens = _ints("context_lens", step.context_lens, 1, sequences)
    copy_from = _ints("copy_from", step.copy_from, 1)
    copy_to = _ints("copy_to", step.copy_to, 1, len(copy_from))

    query_lens = np.diff(query_start)
    _require("query_start", query_lens, query_lens >= 1, "(query length) must be at least 1")
    _require("context_lens", context_lens, context_lens >= query_lens, "is shorter than its query")
    width = context_slots.shape[1]
    _require("context_lens", context_lens, context_lens <= width, f"exceeds context_slots' {width} columns")
    for name, slots in (("slot_mapping", slot_mapping), ("copy_from", copy_from), ("copy_to", copy_to)):
        _require_slots(name, slots, num_slots)
    in_context = np.arange(width) < context_lens[:, None]
    _require_slots("context_slots", np.where(in_context, context_slots, 0), num_slots)
    if len(np.unique(slot_mapping)) != tokens:
        raise ValueError("engine step: slot_mapping writes some slot twice")

    # Query tokens are the last tokens of their sequence's context, at its last positions.
    sequence_of_token = np.repeat(np.arange(sequences), query_lens)
    context_index = (context_lens - query_lens - query_start[:-1])[sequence_of_token] + np.arange(tokens)
    _require("positions", positions, positions == context_index, "is not the token's index in its context")
    _require("positions", positions, positions < max_positions, f"is beyond the model's {max_positions}")
    _require(
        "slot_mapping",
        slot_mapping,
        slot_mapping == context_slots[sequence_of_token, context_index],
        "is not the context slot of the token's position",
    )
    return _Queries(query_start, query_lens, context_lens, sequence_of_token, context_index)


def _check_rows(step: EngineStep, query_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The sampled rows: their sequences, drafts and sampling settings.

    Returns ``sample_seq``, ``draft_lens`` and ``K``, the most drafts a row may verify.
    """
    sequences = len(query_lens)
    sample_seq = _ints("sample_seq", step.sample_seq, 1)
    rows = len(sample_seq)
    draft_lens = _ints("draft_lens", step.draft_lens, 1, rows)
    top_k = _ints("top_k", step.top_k, 1, rows)
    temperature = _floats("temperature", step.temperature, 1, rows)
    top_p = _floats("top_p", step.top_p, 1, rows)
    uniforms = _floats("uniforms", step.uniforms, 3, rows)

    max_drafts = uniforms.shape[1] - 1
    if max_drafts < 0 or uniforms.shape[2] != 3:
        raise ValueError(f"engine step: uniforms must be [rows, K + 1, 3], got {list(uniforms.shape)}")
    _require("sample_seq", sample_seq, (sample_seq >= 0) & (sample_seq < sequences), "is not a sequence")
    _require("draft_lens", draft_lens, draft_lens >= 0, "is negative")
    _require("draft_lens", draft_lens, draft_lens <= max_drafts, f"exceeds K = {max_drafts} of uniforms")
    _require(
        "draft_lens",
        draft_lens,
        draft_lens < query_lens[sample_seq],
        "leaves no query token before the drafts",
    )
    readers = np.bincount(sample_seq, minlength=sequences)
    _require(
        "sample_seq",
        sample_seq,
        (draft_lens == 0) | (readers[sample_seq] == 1),
        "is a sequence with drafts read by several rows",
    )
    _require("temperature", temperature, temperature >= 0, "is negative (0 is greedy)")
    _require("top_p", top_p, (top_p > 0) & (top_p <= 1), "is not in (0, 1]")
    _require("top_k", top_k, top_k >= 0, "is negative (0 disables)")
    _require("uniforms", uniforms, (uniforms >= 0) & (uniforms < 1), "is not in [0, 1)")
    return sample_seq, draft_lens, max_drafts


def _check_input_ids(
    input_ids: np.ndarray,
    is_draft: np.ndarray,
    vocab_size: int,
    draft_with_model: bool,
    has_draft_model: bool,
) -> None:
    if draft_with_model:
        if not has_draft_model:
            raise ValueError("engine step: draft_with_model is set but the policy has no draft_model_path")
        _require("input_ids", input_ids, ~is_draft | (input_ids == -1), "is a draft to propose but not -1")
    known = input_ids >= 0
    _require(
        "input_ids",
        input_ids,
        known | (is_draft & draft_with_model),
        "is negative (-1 only for drafts of the draft model)",
    )
    _require("input_ids", input_ids, input_ids < vocab_size, f"is beyond the vocabulary ({vocab_size})")


def _ints(name: str, values: np.ndarray, ndim: int, rows: int | None = None) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise ValueError(f"engine step: {name} must hold integers, got {array.dtype}")
    _check_shape(name, array, ndim, rows)
    return array.astype(np.int64, copy=False)


def _floats(name: str, values: np.ndarray, ndim: int, rows: int) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind not in "fiu":
        raise ValueError(f"engine step: {name} must hold numbers, got {array.dtype}")
    _check_shape(name, array, ndim, rows)
    return array


def _check_shape(name: str, array: np.ndarray, ndim: int, rows: int | None) -> None:
    if array.ndim != ndim or (rows is not None and array.shape[0] != rows):
        expected = f"{ndim} dimension(s)" + (f", {rows} along the first" if rows is not None else "")
        raise ValueError(f"engine step: {name} has shape {list(array.shape)}, expected {expected}")


def _require(name: str, values: np.ndarray, ok: np.ndarray, problem: str) -> None:
    """Raise for the first entry of ``values`` where ``ok`` is false (NaN fails every test)."""
    if not np.all(ok):
        index = np.unravel_index(int(np.argmin(ok)), ok.shape)
        where = ", ".join(str(int(i)) for i in index)
        raise ValueError(f"engine step: {name}[{where}] = {values[index]} {problem}")


def _require_slots(name: str, slots: np.ndarray, num_slots: int) -> None:
    _require(name, slots, (slots >= 0) & (slots < num_slots), f"is not a slot of the {num_slots}-slot cache")
