"""HFCausalLM on a CUDA device (skipped without one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from policy_helpers import LR, PAIRS, PROMPTS, make_policy, requests, sft_batch
from transformers import AutoModelForCausalLM

from rollout_sdk import SamplingParams
from rollout_sdk.testing import check_policy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_check_policy_float32(tiny_model_dir):
    policy = make_policy(tiny_model_dir, device="cuda")
    assert next(policy.model.parameters()).is_cuda
    check_policy(policy, PROMPTS, max_new_tokens=8)


def test_check_policy_bfloat16(tiny_model_dir):
    # bfloat16 rounds differently in cached and full forward passes: compare loosely.
    policy = make_policy(tiny_model_dir, device="auto", dtype="bfloat16")
    assert policy.describe()["device"] == "cuda"
    check_policy(policy, PROMPTS, max_new_tokens=8, atol=5e-2)


def test_greedy_generation_matches_hf_generate_on_cuda(tiny_model_dir):
    policy = make_policy(tiny_model_dir, device="cuda")
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    groups = policy.generate(requests(policy), SamplingParams(max_new_tokens=12, temperature=0.0))
    for request, (generation,) in zip(requests(policy), groups, strict=True):
        prompt = torch.as_tensor(request.prompt_ids, device="cuda").unsqueeze(0)
        expected = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12
        )[0, prompt.shape[1] :].tolist()
        if generation.finish_reason == "stop":
            expected = expected[: expected.index(policy.eos_token_ids()[0]) + 1]
        assert generation.token_ids.tolist() == expected


def test_checkpoint_round_trip_on_cuda(tiny_model_dir, tmp_path):
    policy = make_policy(tiny_model_dir, device="cuda", gradient_checkpointing=True)
    for _ in range(2):
        policy.train_step(sft_batch(policy, PAIRS))
        policy.apply_update(LR)
    policy.save(str(tmp_path))
    resumed = make_policy(tiny_model_dir, device="cuda", gradient_checkpointing=True)
    resumed.load(str(tmp_path))
    for current in (policy, resumed):
        current.train_step(sft_batch(current, PAIRS))
        current.apply_update(LR)
    expected, got = policy.export_weights(), resumed.export_weights()
    assert all(np.allclose(expected[name], got[name], atol=1e-6) for name in expected)
