"""Shared-prefix (cascade) decode attention against plain softmax attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_driver import DriverOptions, EngineDriver
from policy_helpers import make_policy
from test_paged_attention import NUM_SLOTS, full_forward, paged_model
from transformers import AutoConfig

from python_plugins import paged_attention
from python_plugins.cascade_attention import attend_with_shared_prefixes, find_shared_prefixes
from python_plugins.paged_attention import (
    AttentionPlan,
    has_sliding_windows,
    paged_attention_forward,
    paged_forward,
)

CPU = torch.device("cpu")


def forked_contexts(
    rng: np.random.Generator, families: list[tuple[int, int]], own: list[int], num_slots: int
) -> tuple[np.ndarray, np.ndarray]:
    """Contexts of forked sequences: family ``(members, prefix)`` shares ``prefix`` slots, then
    each member has its own; ``own[i]`` is sequence ``i``'s own length. Padded with slot 0."""
    free = iter(rng.permutation(num_slots).tolist())
    rows: list[list[int]] = []
    for members, prefix in families:
        shared = [next(free) for _ in range(prefix)]
        for _ in range(members):
            rows.append(shared + [next(free) for _ in range(own[len(rows)])])
    width = max(len(row) for row in rows)
    lens = np.asarray([len(row) for row in rows])
    return np.asarray([row + [0] * (width - len(row)) for row in rows]), lens


def reference_attention(queries, cache, slots, lens, scale):
    """Softmax attention of each query over its own context, one sequence at a time."""
    heads, kv_heads = queries.shape[1], cache.shape[2]
    outputs = []
    for query, row, length in zip(queries, slots, lens, strict=True):
        keys = cache[0, row[:length]].repeat_interleave(heads // kv_heads, dim=1)  # [L, heads, dim]
        values = cache[1, row[:length]].repeat_interleave(heads // kv_heads, dim=1)
        weights = (torch.einsum("hd,lhd->hl", query, keys) * scale).softmax(dim=-1)
        outputs.append(torch.einsum("hl,lhd->hd", weights, values))
    return torch.stack(outputs)


def test_families_are_the_sequences_that_share_leading_slots():
    rng = np.random.default_rng(0)
    # Families of 3 and 2 sharing 20 and 9 slots, then a sequence of its own.
    slots, lens = forked_contexts(rng, [(3, 20), (2, 9), (1, 0)], own=[1, 4, 2, 3, 1, 30], num_slots=200)
    found = find_shared_prefixes(slots, lens, CPU)
    assert found is not None
    positions, plan = found
    assert positions.tolist() == [0, 1, 2, 3, 4]
    assert plan.shape == (2, 3, 20, 4)  # (families, largest, longest prefix, longest own part)
    assert plan.prefix_visible.sum().item() == 20 + 9
    assert plan.real_member.sum().item() == 5
    own_lens = (lens - [20, 20, 20, 9, 9, 0])[:5]
    assert plan.own_visible.sum(dim=-1).flatten().tolist() == own_lens.tolist()


def test_prefixes_end_where_members_diverge():
    rng = np.random.default_rng(1)
    slots, lens = forked_contexts(rng, [(4, 16)], own=[2, 2, 2, 2], num_slots=100)
    slots[3, 10:16] = [90, 91, 92, 93, 94, 95]  # the last member left the prefix at slot 10
    found = find_shared_prefixes(slots, lens, CPU)
    assert found is not None
    assert found[1].shape == (1, 4, 10, 8)


def test_too_little_sharing_is_attended_the_plain_way():
    rng = np.random.default_rng(2)
    slots, lens = forked_contexts(rng, [(2, 1), (1, 0), (1, 0)], own=[30, 30, 30, 30], num_slots=200)
    assert find_shared_prefixes(slots, lens, CPU) is None
    distinct = np.arange(12).reshape(4, 3)
    assert find_shared_prefixes(distinct, np.full(4, 3), CPU) is None


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dtype", "tolerance"),
    [(4, 4, torch.float32, 1e-5), (4, 2, torch.float32, 1e-5), (6, 1, torch.bfloat16, 2e-2)],
)
def test_attention_equals_plain_softmax_attention(heads, kv_heads, dtype, tolerance):
    rng = np.random.default_rng(3)
    families = [(3, 21), (5, 7), (2, 16)]
    own = rng.integers(1, 12, size=10).tolist()
    slots, lens = forked_contexts(rng, families, own=own, num_slots=300)
    torch.manual_seed(0)
    cache = torch.randn(2, 300, kv_heads, 8, dtype=dtype)
    queries = torch.randn(len(lens), heads, 8, dtype=dtype)
    found = find_shared_prefixes(slots, lens, CPU)
    assert found is not None and found[0].tolist() == list(range(10))
    attended = attend_with_shared_prefixes(queries, cache, found[1], scale=0.3)
    expected = reference_attention(queries.float(), cache.float(), slots, lens, scale=0.3)
    torch.testing.assert_close(attended.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_gpt2_dir", "tiny_gqa_dir"])
@torch.inference_mode()
def test_a_decode_step_of_forked_samples_matches_the_full_forward(model, request):
    """Three samples of one prompt and two of another plus an unrelated sequence decode in one
    step, as the engine schedules them (the Mistral has a sliding window: no families)."""
    paged = paged_model(request.getfixturevalue(model))
    rng = np.random.default_rng(4)
    slots, lens = forked_contexts(rng, [(3, 12), (2, 9), (1, 0)], own=[3, 1, 5, 2, 4, 6], num_slots=NUM_SLOTS)
    tokens = rng.integers(3, 40, size=slots.shape)
    for members, prefix in (([0, 1, 2], 12), ([3, 4], 9)):  # a family's prompt tokens are the same
        tokens[members, :prefix] = tokens[members[0], :prefix]
    # Fill the cache with each sequence's context but its last token, then decode that token.
    history = [
        (tokens[s, : lens[s] - 1], slots[s, : lens[s] - 1], np.arange(lens[s] - 1)) for s in range(len(lens))
    ]
    for ids, at, positions in history:
        prefill = AttentionPlan(
            slot_mapping=at,
            query_start=np.asarray([0, len(at)]),
            context_slots=at[None],
            context_lens=np.asarray([len(at)]),
            device=CPU,
        )
        paged.logits(torch.tensor(ids), torch.tensor(positions), prefill, torch.arange(len(at)))
    last = lens - 1
    step = AttentionPlan(
        slot_mapping=slots[np.arange(len(lens)), last],
        query_start=np.arange(len(lens) + 1),
        context_slots=slots,
        context_lens=lens,
        device=CPU,
        shared_prefixes=paged.shares_prefixes,
    )
    assert (step.families is not None) == (model != "tiny_gqa_dir")
    logits = paged.logits(
        torch.tensor(tokens[np.arange(len(lens)), last]), torch.tensor(last), step, torch.arange(len(lens))
    )
    for s in range(len(lens)):
        expected = full_forward(paged, tokens[s, : lens[s]].tolist())[-1]
        torch.testing.assert_close(logits[s], expected, atol=1e-5, rtol=1e-5)


def test_models_with_sliding_windows_plan_without_shared_prefixes(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert not has_sliding_windows(config)
    config.layer_types = ["full_attention", "sliding_attention"]
    assert has_sliding_windows(config)
    rng = np.random.default_rng(5)
    slots, lens = forked_contexts(rng, [(4, 16)], own=[2, 2, 2, 2], num_slots=100)
    plan_of = {
        shared: AttentionPlan(
            slot_mapping=slots[np.arange(4), lens - 1],
            query_start=np.arange(5),
            context_slots=slots,
            context_lens=lens,
            device=CPU,
            shared_prefixes=shared,
        )
        for shared in (True, False)
    }
    assert plan_of[True].families is not None
    assert plan_of[False].families is None
    assert len(plan_of[False].groups) == 1


def test_a_sliding_window_layer_refuses_a_plan_with_families(tiny_model_dir):
    paged = paged_model(tiny_model_dir)
    rng = np.random.default_rng(6)
    slots, lens = forked_contexts(rng, [(3, 8)], own=[1, 1, 1], num_slots=NUM_SLOTS)
    plan = AttentionPlan(
        slot_mapping=slots[np.arange(3), lens - 1],
        query_start=np.arange(4),
        context_slots=slots,
        context_lens=lens,
        device=CPU,
    )
    assert plan.families is not None and paged.cache is not None
    layer = paged.model.model.layers[0].self_attn
    heads, kv_heads, dim = 4, paged.cache.kv.shape[3], paged.cache.kv.shape[4]
    query, key = torch.zeros(1, heads, 3, dim), torch.zeros(1, kv_heads, 3, dim)
    with pytest.raises(RuntimeError, match="sliding window"), paged_forward(paged.model, paged.cache, plan):
        paged_attention_forward(layer, query, key, key, None, sliding_window=4)


def test_sampled_completions_are_the_same_with_the_option_off(tiny_model_dir, monkeypatch):
    families_built = []
    plain_init = paged_attention.AttentionPlan.__init__

    def counting_init(self, **kwargs):
        plain_init(self, **kwargs)
        families_built.append(self.families is not None)

    monkeypatch.setattr(paged_attention.AttentionPlan, "__init__", counting_init)
    prompts = [[5, 9, 12, 7, 3, 8, 11, 4, 6, 10], [13, 2, 9, 5, 14, 7, 3, 12, 8]]
    options = DriverOptions(share_prompts=True, block_size=4, temperature=1.0, max_new_tokens=10, seed=3)
    results = {}
    for enabled in (True, False):
        families_built.clear()
        policy = make_policy(tiny_model_dir, shared_prefix_attention=enabled)
        assert policy.engine_runner.target.shares_prefixes is enabled
        results[enabled] = EngineDriver(policy, options).generate(prompts, n=4)
        assert any(families_built) is enabled
    assert sum(len(c.tokens) for group in results[True] for c in group) >= 40  # decodes ran
    for on, off in zip(results[True], results[False], strict=True):
        assert [c.tokens for c in on] == [c.tokens for c in off]
        for a, b in zip(on, off, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
