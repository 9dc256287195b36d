"""The paged attention function against Hugging Face's own forward pass."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, masking_utils

from python_plugins.engine_runner import PagedModel
from python_plugins.paged_attention import (
    ATTENTION_NAME,
    AttentionPlan,
    CacheGeometry,
    PagedKvCache,
    paged_forward,
)

MODELS = ["tiny_model_dir", "tiny_gpt2_dir", "tiny_gqa_dir"]
NUM_SLOTS = 96


@dataclass(frozen=True)
class Piece:
    """Feed ``tokens[start:end]``; the sequence's token ``p`` lives in cache slot ``slots[p]``."""

    tokens: list[int]
    slots: list[int]
    start: int
    end: int


def paged_model(model_dir) -> PagedModel:
    paged = PagedModel(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    paged.allocate(NUM_SLOTS)
    return paged


def sequences(count: int, length: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Random token sequences and disjoint, scattered cache slots for them."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(NUM_SLOTS)[: count * length].reshape(count, length)
    return rng.integers(3, 40, size=(count, length)).tolist(), slots.tolist()


@torch.inference_mode()
def forward(paged: PagedModel, pieces: list[Piece]) -> list[torch.Tensor]:
    """One packed forward over the pieces; the logits of every fed token, per piece."""
    lens = [p.end - p.start for p in pieces]
    width = max(p.end for p in pieces)
    plan = AttentionPlan(
        slot_mapping=np.concatenate([p.slots[p.start : p.end] for p in pieces]),
        query_start=np.concatenate([[0], np.cumsum(lens)]),
        context_slots=np.asarray([p.slots[: p.end] + [0] * (width - p.end) for p in pieces]),
        context_lens=np.asarray([p.end for p in pieces]),
        device=torch.device("cpu"),
    )
    ids = torch.tensor([t for p in pieces for t in p.tokens[p.start : p.end]])
    positions = torch.tensor([i for p in pieces for i in range(p.start, p.end)])
    logits = paged.logits(ids, positions, plan, torch.arange(sum(lens)))
    return list(logits.split(lens))


@torch.inference_mode()
def full_forward(paged: PagedModel, tokens: list[int]) -> torch.Tensor:
    return paged.model(torch.tensor([tokens]), use_cache=False).logits[0]


@pytest.mark.parametrize("model", MODELS)
def test_chunks_of_one_sequence_match_the_full_forward(model, request):
    paged = paged_model(request.getfixturevalue(model))
    (tokens,), (slots,) = sequences(1, 20, seed=0)
    cuts = [0, 7, 8, 13, 20]
    chunks = [forward(paged, [Piece(tokens, slots, a, b)])[0] for a, b in itertools.pairwise(cuts)]
    torch.testing.assert_close(torch.cat(chunks), full_forward(paged, tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_a_mixed_step_matches_separate_steps(model, request):
    model_dir = request.getfixturevalue(model)
    (a, b, c), (slots_a, slots_b, slots_c) = sequences(3, 12, seed=1)
    # B and C have a cached prefix; then a prefill chunk of A runs with one decode of each.
    preface = [Piece(b, slots_b, 0, 8), Piece(c, slots_c, 0, 5)]
    pieces = [Piece(b, slots_b, 8, 9), Piece(a, slots_a, 0, 7), Piece(c, slots_c, 5, 6)]

    mixed = paged_model(model_dir)
    forward(mixed, preface)
    together = forward(mixed, pieces)

    separate = paged_model(model_dir)
    forward(separate, preface)
    for piece, logits in zip(pieces, together, strict=True):
        torch.testing.assert_close(logits, forward(separate, [piece])[0], atol=1e-5, rtol=1e-5)
        expected = full_forward(separate, piece.tokens[: piece.end])[piece.start :]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_transformers_builds_no_mask(tiny_model_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a mask was built")

    for name in list(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping):
        monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, refuse)
    paged = paged_model(tiny_model_dir)
    (tokens,), (slots,) = sequences(1, 10, seed=2)
    forward(paged, [Piece(tokens, slots, 0, 10)])
    assert paged.model.config._attn_implementation == "sdpa"
    with pytest.raises(AssertionError, match="a mask was built"):
        full_forward(paged, tokens)


def test_the_attention_is_switched_back_after_an_error(tiny_model_dir):
    paged = paged_model(tiny_model_dir)
    plan = AttentionPlan(
        slot_mapping=np.asarray([0]),
        query_start=np.asarray([0, 1]),
        context_slots=np.asarray([[0]]),
        context_lens=np.asarray([1]),
        device=torch.device("cpu"),
    )
    assert paged.cache is not None
    with pytest.raises(KeyError), paged_forward(paged.model, paged.cache, plan):
        assert paged.model.config._attn_implementation == ATTENTION_NAME
        raise KeyError("inside")
    assert paged.model.config._attn_implementation == "sdpa"
    paged.model.config._attn_implementation = ATTENTION_NAME
    with pytest.raises(RuntimeError, match="only inside `paged_forward`"):
        paged.model(torch.tensor([[5]]), use_cache=False)


def test_a_layer_that_bypasses_the_cache_is_an_error(tiny_model_dir):
    paged = paged_model(tiny_model_dir)
    paged.model.config.num_hidden_layers = 1  # Llama then runs only the first layer
    (tokens,), (slots,) = sequences(1, 4, seed=3)
    with pytest.raises(RuntimeError, match="only 1 of 2 layers ran"):
        forward(paged, [Piece(tokens, slots, 0, 4)])
    assert paged.model.config._attn_implementation == "sdpa"


def test_a_model_the_engine_cannot_run_is_refused(tiny_gpt2_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    monkeypatch.setattr(model, "forward", lambda input_ids, **kwargs: None)
    with pytest.raises(NotImplementedError, match="has no `logits_to_keep`"):
        PagedModel(model)
    monkeypatch.setattr(type(model), "_supports_attention_backend", False)
    with pytest.raises(NotImplementedError, match="AttentionInterface"):
        PagedModel(model)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_host_cache_is_resident_only_where_written():
    before = resident_bytes()
    geometry = CacheGeometry(num_layers=4, num_kv_heads=4, head_dim=64)
    cache = PagedKvCache(geometry, num_slots=32768, device=torch.device("cpu"), dtype=torch.float32)
    assert cache.kv.numel() * 4 == 256 * 2**20
    cache.kv[:, :, 1000:1016] = 1.0  # one 16-slot block in every layer
    assert resident_bytes() - before < 16 * 2**20
    assert cache.kv[:, :, :1000].abs().max().item() == 0.0
    assert cache.kv.sum().item() == 4 * 2 * 16 * 4 * 64
