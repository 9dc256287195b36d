"""HFCausalLM's memory options on a CUDA device (skipped without one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from policy_helpers import LR, PAIRS, PROMPTS, grpo_batch, make_policy, sft_batch

from python_plugins.model_setup import CpuOffloadOptimizer
from rollout_sdk import GrpoObjective
from rollout_sdk.testing import check_policy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "device": "cuda"}


def train(policy, steps: int = 3) -> None:
    batch = sft_batch(policy, PAIRS)
    for _ in range(steps):
        policy.train_step(batch)
        policy.apply_update(LR)


@pytest.mark.parametrize("quantization", ["none", "int8", "nf4"])
def test_check_policy_with_lora_on_cuda(tiny_model_dir, quantization):
    policy = make_policy(tiny_model_dir, quantization=quantization, **LORA)
    assert all(p.is_cuda for p in policy.trainable_parameters())
    check_policy(policy, PROMPTS, max_new_tokens=8, atol=5e-2 if quantization == "int8" else 1e-4)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_offloaded_optimizer_keeps_its_state_on_the_host_and_updates_alike(tiny_model_dir, optimizer):
    offloaded = make_policy(tiny_model_dir, device="cuda", optimizer=optimizer, offload_optimizer=True)
    on_device = make_policy(tiny_model_dir, device="cuda", optimizer=optimizer)
    assert isinstance(offloaded.optimizer, CpuOffloadOptimizer)
    assert all(p.is_cuda for p in offloaded.trainable_parameters())
    for policy in (offloaded, on_device):
        train(policy)
    state = offloaded.optimizer.state_dict()["state"]
    tensors = [v for values in state.values() for v in values.values() if torch.is_tensor(v)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    expected, got = on_device.export_weights(), offloaded.export_weights()
    # The same update, computed by the CPU's kernels instead of CUDA's.
    assert all(np.allclose(expected[n], got[n], atol=1e-5) for n in expected)


def test_offloaded_qlora_resumes_exactly_on_cuda(tiny_model_dir, tmp_path):
    options = {**LORA, "quantization": "nf4", "optimizer": "adamw_8bit", "offload_optimizer": True}
    policy = make_policy(tiny_model_dir, **options)
    train(policy, steps=2)
    policy.save(str(tmp_path))
    resumed = make_policy(tiny_model_dir, **options)
    resumed.load(str(tmp_path))
    for current in (policy, resumed):
        train(current, steps=1)
    expected, got = policy.export_weights(), resumed.export_weights()
    assert all(np.allclose(expected[n], got[n], atol=1e-6) for n in expected)


def test_lora_reference_on_cuda_needs_no_second_model(tiny_model_dir):
    torch.cuda.reset_peak_memory_stats()
    policy = make_policy(tiny_model_dir, **LORA)
    before = torch.cuda.memory_allocated()
    first = policy.train_step(grpo_batch(policy, GrpoObjective(kl_coef=0.1)))
    policy.optimizer.zero_grad(set_to_none=True)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    # No reference weights were allocated (only transient activations, now freed).
    assert torch.cuda.memory_allocated() - before < sum(
        p.numel() * p.element_size() for p in policy.model.parameters()
    )
