"""HFCausalLM's sampling-engine hooks, driven the way the Rust scheduler drives them."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_driver import DriverOptions, EngineDriver, prompt_lookup
from policy_helpers import PROMPTS, make_policy, right_padded
from transformers import AutoConfig, AutoModelForCausalLM

from python_plugins.engine_runner import available_memory
from rollout_sdk import EngineStep, TokenBatch

MODELS = ["tiny_model_dir", "tiny_gpt2_dir", "tiny_gqa_dir"]
PROMPTS_OF_MIXED_LENGTHS = [*PROMPTS, "12+34=12+34=", "9"]
MAX_NEW_TOKENS = 12


@functools.cache
def hf_greedy(model_dir: Path, prompt: tuple[int, ...]) -> list[int]:
    """Hugging Face's greedy completion (with its own KV cache), cut after the first EOS."""
    model = _hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS
    )
    completion = out[0, len(prompt) :].tolist()
    eos = model.generation_config.eos_token_id
    return completion[: completion.index(eos) + 1] if eos in completion else completion


@functools.cache
def _hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def oracle_drafter(expected: list[list[int]], count: int = 3):
    """Drafts the known continuation, with every third drafted token wrong."""

    def drafter(tokens: list[int]) -> list[int]:
        for sequence in expected:
            if sequence[: len(tokens)] == tokens:
                drafts = sequence[len(tokens) : len(tokens) + count]
                return [(t + 1) % 40 if (len(tokens) + i) % 3 == 0 else t for i, t in enumerate(drafts)]
        return []

    return drafter


def prompts_of(policy) -> list[list[int]]:
    return policy.encode(PROMPTS_OF_MIXED_LENGTHS)


def expected_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(model_dir, tuple(p)) for p in prompts]


def teacher_forced(policy, prompts, completions, temperature: float) -> list[np.ndarray]:
    ids, mask = right_padded([p + c.tokens for p, c in zip(prompts, completions, strict=True)])
    logprobs = policy.logprobs(TokenBatch(input_ids=ids, attention_mask=mask, temperature=temperature))
    return [
        logprobs[row, len(p) : len(p) + len(c.tokens)]
        for row, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]


SCHEDULES = {
    "one-step-prefill": (DriverOptions(), 1),
    "group-fork": (DriverOptions(share_prompts=True, block_size=4), 3),
    "chunked-prefill": (DriverOptions(share_prompts=True, token_budget=7, block_size=2), 2),
    "prompt-lookup-drafts": (DriverOptions(max_drafts=3, drafter=prompt_lookup(1)), 1),
}


@pytest.mark.parametrize("schedule", [*SCHEDULES, "oracle-drafts"])
@pytest.mark.parametrize("model", MODELS)
def test_greedy_matches_hf_generate(model, schedule, request):
    model_dir = request.getfixturevalue(model)
    policy = make_policy(model_dir)
    prompts = prompts_of(policy)
    expected = expected_greedy(model_dir, prompts)
    if schedule == "oracle-drafts":
        full = [p + e for p, e in zip(prompts, expected, strict=True)]
        options, n = DriverOptions(max_drafts=3, drafter=oracle_drafter(full), token_budget=9), 1
    else:
        options, n = SCHEDULES[schedule]
    driver = EngineDriver(policy, options)
    groups = driver.generate(prompts, n=n)
    for group, tokens in zip(groups, expected, strict=True):
        assert [c.tokens for c in group] == [tokens] * n
    completions = [group[0] for group in groups]
    for completion, logprobs in zip(
        completions, teacher_forced(policy, prompts, completions, 1.0), strict=True
    ):
        np.testing.assert_allclose(completion.logprobs, logprobs, atol=1e-4)
    if schedule == "group-fork":
        assert driver.stats.copies > 0
    if schedule == "chunked-prefill":
        assert driver.stats.mixed_steps > 0
    if schedule == "oracle-drafts":
        assert 0 < driver.stats.accepted < driver.stats.drafted
    assert policy.model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("model", MODELS)
def test_weight_first_matmuls_keep_greedy_outputs(model, request):
    """Every linear layer forced weight first (python_plugins/decode_matmuls.py)."""
    model_dir = request.getfixturevalue(model)
    policy = make_policy(model_dir, engine_matmuls="weight_first")
    prompts = prompts_of(policy)
    options, n = SCHEDULES["group-fork"]
    groups = EngineDriver(policy, options).generate(prompts, n=n)
    for group, tokens in zip(groups, expected_greedy(model_dir, prompts), strict=True):
        assert [c.tokens for c in group] == [tokens] * n


@pytest.mark.parametrize("schedule", ["group-fork", "chunked-prefill", "prompt-lookup-drafts", "draft-model"])
def test_sampled_logprobs_match_teacher_forcing(tiny_model_dir, tiny_gpt2_dir, schedule):
    temperature = 0.7
    sampling = {"temperature": temperature, "top_k": 8, "top_p": 0.9, "seed": 4}
    if schedule == "draft-model":
        policy = make_policy(tiny_model_dir, draft_model_path=str(tiny_gpt2_dir))
        options, n = DriverOptions(max_drafts=3, **sampling), 2
    else:
        policy = make_policy(tiny_model_dir)
        options, n = SCHEDULES[schedule]
        options = dataclasses.replace(options, **sampling)
    prompts = prompts_of(policy)
    groups = EngineDriver(policy, options).generate(prompts, n=n)
    flat_prompts = [p for p in prompts for _ in range(n)]
    completions = [c for group in groups for c in group]
    assert all(len(c.tokens) > 0 for c in completions)
    expected = teacher_forced(policy, flat_prompts, completions, temperature)
    for completion, logprobs in zip(completions, expected, strict=True):
        np.testing.assert_allclose(completion.logprobs, logprobs, atol=1e-4)


@pytest.mark.parametrize("drafts", [0, 3])
def test_sampled_tokens_do_not_depend_on_the_rest_of_the_batch(tiny_model_dir, drafts):
    policy = make_policy(tiny_model_dir)
    options = DriverOptions(temperature=1.0, top_p=0.95, seed=7, max_drafts=drafts, drafter=prompt_lookup(1))
    prompts = prompts_of(policy)
    together = EngineDriver(policy, options).generate(prompts)
    for index, prompt in enumerate(prompts):
        alone = EngineDriver(policy, options).generate([prompt], first_sample=index)
        assert alone[0][0].tokens == together[index][0].tokens
    other_seed = EngineDriver(policy, dataclasses.replace(options, seed=8)).generate(prompts)
    assert [g[0].tokens for g in other_seed] != [g[0].tokens for g in together]


@pytest.mark.parametrize("draft", ["tiny_model_dir", "wide_draft_dir"], ids=["itself", "small-gpt2"])
def test_draft_model_speculation_keeps_greedy_outputs(tiny_model_dir, draft, request):
    policy = make_policy(tiny_model_dir, draft_model_path=str(request.getfixturevalue(draft)))
    prompts = prompts_of(policy)
    # A token budget makes steps that prefill without drafting, which the draft cache must follow.
    driver = EngineDriver(policy, DriverOptions(max_drafts=3, token_budget=8))
    groups = driver.generate(prompts)
    assert [g[0].tokens for g in groups] == expected_greedy(tiny_model_dir, prompts)
    assert driver.stats.drafted > 0
    if draft == "tiny_model_dir":
        assert driver.stats.accepted == driver.stats.drafted
    else:
        assert driver.stats.accepted < driver.stats.drafted


@pytest.mark.parametrize("model", MODELS)
def test_kv_layout_and_allocation(model, request):
    model_dir = request.getfixturevalue(model)
    config = AutoConfig.from_pretrained(model_dir)
    policy = make_policy(model_dir, dtype="bfloat16")
    layout = policy.kv_layout()
    heads = config.num_attention_heads
    assert layout.num_layers == config.num_hidden_layers == 2
    assert layout.num_kv_heads == getattr(config, "num_key_value_heads", heads)
    assert layout.head_dim == config.hidden_size // heads
    assert layout.dtype_bytes == 2
    assert layout.max_positions == 64
    assert 0 < layout.available_bytes <= available_memory(torch.device("cpu")) * 1.1
    policy.allocate_kv(10)
    kv = policy.engine_runner.target.cache.kv
    assert kv.shape == (2, 2, 10, layout.num_kv_heads, layout.head_dim)
    assert kv.dtype == torch.bfloat16
    assert kv.numel() * kv.element_size() == 10 * layout.bytes_per_slot()
    policy.allocate_kv(3)
    assert policy.engine_runner.target.cache.kv.shape[2] == 3


def test_kv_layout_of_a_model_the_engine_cannot_run_asks_for_generate(tiny_gpt2_dir, monkeypatch):
    policy = make_policy(tiny_gpt2_dir)
    monkeypatch.setattr(type(policy.model), "_supports_attention_backend", False)
    with pytest.raises(NotImplementedError, match="AttentionInterface"):
        policy.kv_layout()


def test_a_draft_model_shares_the_memory_and_the_slots(tiny_model_dir, wide_draft_dir):
    alone = make_policy(tiny_model_dir).kv_layout()
    policy = make_policy(tiny_model_dir, draft_model_path=str(wide_draft_dir))
    layout = policy.kv_layout()
    assert dataclasses.replace(layout, available_bytes=0) == dataclasses.replace(alone, available_bytes=0)
    # Target: 2 layers x 2 heads x 16; draft: 1 layer x 4 heads x 8 -> the target has 2/3 of the bytes.
    assert layout.available_bytes == pytest.approx(alone.available_bytes * 2 / 3, rel=0.05)
    policy.allocate_kv(12)
    assert policy.engine_runner.draft.cache.kv.shape == (1, 2, 12, 4, 8)


def one_sequence_step(tokens: list[int], slots: list[int], **changes) -> EngineStep:
    """A greedy prefill of one sequence whose token ``p`` goes to ``slots[p]``."""
    fields = {
        "input_ids": np.asarray(tokens),
        "positions": np.arange(len(tokens)),
        "slot_mapping": np.asarray(slots),
        "query_start": np.asarray([0, len(tokens)]),
        "context_slots": np.asarray([slots]),
        "context_lens": np.asarray([len(tokens)]),
        "sample_seq": np.asarray([0]),
        "draft_lens": np.asarray([0]),
        "temperature": np.zeros(1, dtype=np.float32),
        "top_p": np.ones(1, dtype=np.float32),
        "top_k": np.zeros(1, dtype=np.int64),
        "uniforms": np.full((1, 1, 3), 0.5),
        "copy_from": np.zeros(0, dtype=np.int64),
        "copy_to": np.zeros(0, dtype=np.int64),
    }
    return EngineStep(**{**fields, **changes})


def test_copy_on_write_copies_exactly_the_requested_slots_in_every_layer(tiny_model_dir, tiny_gpt2_dir):
    policy = make_policy(tiny_model_dir, draft_model_path=str(tiny_gpt2_dir))
    policy.allocate_kv(16)
    caches = [policy.engine_runner.target.cache.kv, policy.engine_runner.draft.cache.kv]
    for cache in caches:
        cache.copy_(torch.randn(cache.shape))
    before = [cache.clone() for cache in caches]
    # Slot 9 receives 2 and 10 receives 9 (as it was before the step); the prefill writes 0 and 1.
    step = one_sequence_step([5, 6], [0, 1], copy_from=np.asarray([2, 9]), copy_to=np.asarray([9, 10]))
    policy.engine_step(step)
    for cache, old in zip(caches, before, strict=True):
        torch.testing.assert_close(cache[:, :, [9, 10]], old[:, :, [2, 9]], rtol=0, atol=0)
        untouched = [s for s in range(16) if s not in (0, 1, 9, 10)]
        torch.testing.assert_close(cache[:, :, untouched], old[:, :, untouched], rtol=0, atol=0)
        assert not torch.equal(cache[:, :, [0, 1]], old[:, :, [0, 1]])


def test_a_step_without_rows_only_fills_the_cache(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    policy.allocate_kv(16)
    tokens, slots = [5, 9, 7, 12, 30, 8], [3, 14, 0, 6, 11, 2]
    whole = policy.engine_step(one_sequence_step(tokens, slots))
    no_rows = {
        name: np.zeros((0, 1, 3) if name == "uniforms" else 0, dtype=dtype)
        for name, dtype in [
            ("sample_seq", np.int64),
            ("draft_lens", np.int64),
            ("temperature", np.float32),
            ("top_p", np.float32),
            ("top_k", np.int64),
            ("uniforms", np.float64),
        ]
    }
    first = one_sequence_step(tokens[:4], slots[:4], **no_rows)
    output = policy.engine_step(first)
    assert output.tokens.shape == (0, 1)
    assert output.counts.shape == (0,)
    rest = one_sequence_step(
        tokens,
        slots,
        input_ids=np.asarray(tokens[4:]),
        positions=np.arange(4, 6),
        slot_mapping=np.asarray(slots[4:]),
        query_start=np.asarray([0, 2]),
    )
    chunked = policy.engine_step(rest)
    assert chunked.tokens.tolist() == whole.tokens.tolist()
    np.testing.assert_allclose(chunked.logprobs, whole.logprobs, atol=1e-5)


def test_engine_step_needs_an_allocated_cache(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    with pytest.raises(RuntimeError, match="before allocate_kv"):
        policy.engine_step(one_sequence_step([5, 6], [0, 1]))
    with pytest.raises(ValueError, match="num_slots must be positive"):
        policy.allocate_kv(0)


def decode_with_drafts(**changes) -> EngineStep:
    """Sequence 0 prefills 3 tokens; sequence 1 feeds one token and one draft after 2 cached ones."""
    fields = {
        "input_ids": np.asarray([5, 6, 7, 8, 9]),
        "positions": np.asarray([0, 1, 2, 2, 3]),
        "slot_mapping": np.asarray([0, 1, 2, 7, 8]),
        "query_start": np.asarray([0, 3, 5]),
        "context_slots": np.asarray([[0, 1, 2, 0], [5, 6, 7, 8]]),
        "context_lens": np.asarray([3, 4]),
        "sample_seq": np.asarray([0, 1]),
        "draft_lens": np.asarray([0, 1]),
        "temperature": np.asarray([0.0, 1.0], dtype=np.float32),
        "top_p": np.ones(2, dtype=np.float32),
        "top_k": np.zeros(2, dtype=np.int64),
        "uniforms": np.full((2, 2, 3), 0.5),
        "copy_from": np.asarray([3]),
        "copy_to": np.asarray([4]),
    }
    return EngineStep(**{**fields, **changes})


INVALID_STEPS = {
    "slot out of range": (
        {"slot_mapping": np.asarray([0, 1, 2, 7, 16])},
        "slot_mapping\\[4\\] = 16 is not a slot",
    ),
    "context slot out of range": (
        {"context_slots": np.asarray([[0, 1, 2, 0], [5, 99, 7, 8]])},
        "context_slots\\[1, 1\\] = 99 is not a slot",
    ),
    "copy slot out of range": ({"copy_to": np.asarray([-1])}, "copy_to\\[0\\] = -1 is not a slot"),
    "copies of different lengths": ({"copy_to": np.asarray([4, 5])}, "copy_to has shape \\[2\\]"),
    "context shorter than query": ({"context_lens": np.asarray([2, 4])}, "shorter than its query"),
    "context longer than its slots": ({"context_lens": np.asarray([3, 5])}, "exceeds context_slots"),
    "wrong position": ({"positions": np.asarray([0, 1, 2, 3, 3])}, "positions\\[3\\] = 3 is not the token's"),
    "slot not in the context": ({"slot_mapping": np.asarray([0, 1, 2, 7, 9])}, "not the context slot"),
    "slot written twice": (
        {
            "slot_mapping": np.asarray([0, 1, 2, 2, 8]),
            "context_slots": np.asarray([[0, 1, 2, 0], [5, 6, 2, 8]]),
        },
        "writes some slot twice",
    ),
    "query_start not covering the tokens": ({"query_start": np.asarray([0, 3, 4])}, "query_start must run"),
    "empty query": ({"query_start": np.asarray([0, 5, 5])}, "query_start\\[1\\] = 0"),
    "row of a missing sequence": (
        {"sample_seq": np.asarray([0, 2])},
        "sample_seq\\[1\\] = 2 is not a sequence",
    ),
    "more drafts than uniforms": ({"draft_lens": np.asarray([0, 2])}, "exceeds K = 1"),
    "drafts fill the query": (
        {"draft_lens": np.asarray([0, 2]), "uniforms": np.full((2, 3, 3), 0.5)},
        "leaves no query token",
    ),
    "drafted sequence read twice": (
        {
            "sample_seq": np.asarray([1, 1]),
            "temperature": np.zeros(2, dtype=np.float32),
        },
        "with drafts read by several rows",
    ),
    "uniform of one": ({"uniforms": np.full((2, 2, 3), 1.0)}, "uniforms\\[0, 0, 0\\] = 1.0 is not in"),
    "uniforms without positions": ({"uniforms": np.full((2, 3), 0.5)}, "uniforms has shape \\[2, 3\\]"),
    "negative temperature": ({"temperature": np.asarray([0.0, -1.0], dtype=np.float32)}, "is negative"),
    "NaN temperature": (
        {"temperature": np.asarray([0.0, np.nan], dtype=np.float32)},
        "temperature\\[1\\] = nan",
    ),
    "top_p of zero": ({"top_p": np.asarray([1.0, 0.0], dtype=np.float32)}, "top_p\\[1\\] = 0.0 is not in"),
    "negative top_k": ({"top_k": np.asarray([0, -2])}, "top_k\\[1\\] = -2 is negative"),
    "placeholder without draft model": (
        {"input_ids": np.asarray([5, 6, 7, 8, -1])},
        "input_ids\\[4\\] = -1 is negative",
    ),
    "token beyond the vocabulary": ({"input_ids": np.asarray([5, 6, 7, 8, 1000])}, "beyond the vocabulary"),
    "float token ids": ({"input_ids": np.asarray([5.0, 6, 7, 8, 9])}, "input_ids must hold integers"),
    "drafts for a missing draft model": (
        {"input_ids": np.asarray([5, 6, 7, 8, -1]), "draft_with_model": True},
        "no draft_model_path",
    ),
}


@pytest.mark.parametrize("case", INVALID_STEPS)
def test_engine_step_rejects_inconsistent_steps(tiny_model_dir, case):
    policy = make_policy(tiny_model_dir)
    policy.allocate_kv(16)
    policy.engine_step(decode_with_drafts())
    changes, message = INVALID_STEPS[case]
    with pytest.raises(ValueError, match=message):
        policy.engine_step(decode_with_drafts(**changes))


def test_draft_placeholders_are_checked(tiny_model_dir):
    policy = make_policy(tiny_model_dir, draft_model_path=str(tiny_model_dir))
    policy.allocate_kv(16)
    policy.engine_step(decode_with_drafts(input_ids=np.asarray([5, 6, 7, 8, -1]), draft_with_model=True))
    with pytest.raises(ValueError, match="input_ids\\[4\\] = 9 is a draft to propose but not -1"):
        policy.engine_step(decode_with_drafts(draft_with_model=True))
    with pytest.raises(ValueError, match="input_ids\\[3\\] = -1 is negative"):
        policy.engine_step(decode_with_drafts(input_ids=np.asarray([5, 6, 7, -1, -1]), draft_with_model=True))


def test_positions_beyond_the_model_are_rejected(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    policy.allocate_kv(80)
    policy.engine_step(one_sequence_step([5] * 64, list(range(64))))
    with pytest.raises(ValueError, match="positions\\[64\\] = 64 is beyond the model's 64"):
        policy.engine_step(one_sequence_step([5] * 65, list(range(65))))
