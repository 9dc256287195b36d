"""PPO's value head on HFCausalLM: predictions, training only the head during the critic's
warm-up (the policy does not move, not even by Adam's momentum), checkpoints."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from policy_helpers import LR, PAIRS, grpo_batch, make_policy, sft_batch

from rollout_sdk import GrpoObjective, PpoObjective, TrainBatch
from rollout_sdk.snapshot import write_snapshot


def ppo_batch(policy, train_policy: bool) -> TrainBatch:
    batch = grpo_batch(policy, GrpoObjective())
    returns = np.where(batch.loss_mask > 0, 1.0, 0.0).astype(np.float32)
    return dataclasses.replace(
        batch,
        objective=PpoObjective(train_policy=train_policy),
        returns=returns,
        old_values=policy.values(batch),
    )


def policy_weights(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in policy.trainable]


def test_values_are_aligned_with_the_tokens_and_start_at_zero(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    batch = grpo_batch(policy, GrpoObjective())
    values = policy.values(batch)
    assert values.shape == batch.input_ids.shape and values.dtype == np.float32
    assert np.all(values == 0.0), "the head's last layer starts at zero"
    assert policy.trainable_parameters()[-1] is policy.value_head.module[2].bias


def test_critic_warm_up_moves_only_the_value_head(tiny_model_dir):
    policy = make_policy(tiny_model_dir)
    # An SFT update first leaves momentum in the policy's optimizer.
    policy.train_step(sft_batch(policy, PAIRS))
    policy.apply_update(LR)
    before = policy_weights(policy)
    batch = ppo_batch(policy, train_policy=False)
    metrics = policy.train_step(batch)
    # As a data-parallel rank's gradient reducer does: missing gradients become zeros.
    for parameter in policy.trainable_parameters():
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    update = policy.apply_update(LR)
    assert update["grad_norm"] == 0.0 and update["value_grad_norm"] > 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, policy_weights(policy), strict=True))
    assert np.any(policy.values(batch) != 0.0)
    assert metrics["value_loss"] > 0.0

    policy.train_step(ppo_batch(policy, train_policy=True))
    assert policy.apply_update(LR)["grad_norm"] > 0.0
    assert not all(torch.equal(a, b) for a, b in zip(before, policy_weights(policy), strict=True))


def test_the_value_head_round_trips_through_a_checkpoint(tiny_model_dir, tmp_path):
    policy = make_policy(tiny_model_dir)
    batch = ppo_batch(policy, train_policy=True)
    policy.train_step(batch)
    policy.apply_update(LR)
    write_snapshot(policy.snapshot(), tmp_path)
    assert (tmp_path / "value_head" / "weights.safetensors").is_file()
    restored = make_policy(tiny_model_dir)
    restored.load(str(tmp_path))
    np.testing.assert_array_equal(restored.values(batch), policy.values(batch))
    # The optimizer state came back too: the next update is identical.
    for each in (policy, restored):
        each.train_step(batch)
        each.apply_update(LR)
    np.testing.assert_array_equal(restored.values(batch), policy.values(batch))
