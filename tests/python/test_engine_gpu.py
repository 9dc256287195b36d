"""The sampling-engine hooks on a CUDA device (skipped without one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_driver import DriverOptions, EngineDriver, prompt_lookup
from policy_helpers import PROMPTS, make_policy, right_padded
from transformers import AutoModelForCausalLM

from rollout_sdk import TokenBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    ("options", "n"),
    [
        (DriverOptions(share_prompts=True, token_budget=7), 2),
        (DriverOptions(max_drafts=3, drafter=prompt_lookup(1)), 1),
        (DriverOptions(max_drafts=3), 1),
    ],
    ids=["group-fork-chunked", "prompt-lookup", "draft-model"],
)
def test_greedy_engine_matches_hf_generate_on_cuda(tiny_model_dir, tiny_gpt2_dir, options, n):
    policy = make_policy(tiny_model_dir, device="cuda", draft_model_path=str(tiny_gpt2_dir))
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    prompts = policy.encode(PROMPTS)
    groups = EngineDriver(policy, options).generate(prompts, n=n)
    eos = policy.eos_token_ids()[0]
    for prompt, group in zip(prompts, groups, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        expected = out[0, len(prompt) :].tolist()
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        assert [c.tokens for c in group] == [expected] * n


def test_bfloat16_sampled_logprobs_match_teacher_forcing_on_cuda(tiny_model_dir):
    policy = make_policy(tiny_model_dir, device="cuda", dtype="bfloat16")
    prompts = policy.encode(PROMPTS)
    options = DriverOptions(
        temperature=0.8, top_p=0.9, share_prompts=True, max_drafts=2, drafter=prompt_lookup(1)
    )
    groups = EngineDriver(policy, options).generate(prompts, n=3)
    flat = [(p, c) for p, group in zip(prompts, groups, strict=True) for c in group]
    ids, mask = right_padded([p + c.tokens for p, c in flat])
    teacher = policy.logprobs(TokenBatch(input_ids=ids, attention_mask=mask, temperature=0.8))
    for row, (prompt, completion) in enumerate(flat):
        got = teacher[row, len(prompt) : len(prompt) + len(completion.tokens)]
        # bfloat16 rounds differently in paged and full forward passes: compare loosely.
        np.testing.assert_allclose(completion.logprobs, got, atol=5e-2)


def test_kv_layout_reports_free_cuda_memory(tiny_model_dir):
    policy = make_policy(tiny_model_dir, device="cuda")
    free = torch.cuda.mem_get_info()[0]
    assert policy.kv_layout().available_bytes == pytest.approx(free, rel=0.05)
    policy.allocate_kv(1000)
    assert policy.engine_runner.target.cache.kv.is_cuda
