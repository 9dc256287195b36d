"""One bad sample cannot poison an update (docs/security.md): exponentiated log-ratios are
clamped, rows whose loss is not finite are left out and listed, a non-finite gradient on any
data-parallel rank drops the update on every rank, and HFCausalLM never steps on NaN."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_sdk import DpoObjective, GrpoObjective, GspoObjective, PpoObjective, TrainBatch
from rollout_sdk.objectives import LOG_RATIO_BOUND, objective_loss
from tests.python.policy_helpers import grpo_batch, make_policy

WORKER = Path(__file__).parents[1] / "fixtures" / "nonfinite_rank.py"
POISON = -95.0  # a behaviour logprob whose exp(-old) overflows float32 (past exp(88.7))


def batch(objective, rows: int = 2, width: int = 4, **arrays: np.ndarray) -> TrainBatch:
    """`rows` rows of `width` tokens, the loss on tokens 1.., advantage 1 on every row."""
    mask = np.ones((rows, width), dtype=np.float32)
    mask[:, 0] = 0.0
    fields = {
        "input_ids": np.zeros((rows, width), dtype=np.int64),
        "attention_mask": np.ones((rows, width), dtype=np.int64),
        "loss_mask": mask,
        "advantages": mask.copy(),
        "old_logprobs": np.full((rows, width), -1.0, dtype=np.float32) * mask,
        "loss_scale": 1.0 / float(mask.sum()),
        "objective": objective,
    }
    if isinstance(objective, PpoObjective):
        fields["returns"] = mask.copy()
        fields["old_values"] = np.zeros_like(mask)
    fields.update(arrays)
    return TrainBatch(**fields)


def policy_logprobs(rows: int = 2, width: int = 4) -> torch.Tensor:
    return torch.full((rows, width), -1.0).requires_grad_()


@pytest.mark.parametrize(
    "objective",
    [
        GrpoObjective(),
        GrpoObjective(kl_coef=0.1),
        GspoObjective(),
        PpoObjective(),
    ],
    ids=["grpo", "grpo_k3_kl", "gspo", "ppo"],
)
def test_a_behaviour_logprob_of_minus_95_gives_a_finite_loss_and_gradient(objective) -> None:
    # Without the clamp exp(-1 - (-95)) is inf in float32: an inf loss or a NaN gradient.
    old = np.full((2, 4), -1.0, dtype=np.float32)
    old[0, 1:] = POISON
    advantages = np.ones((2, 4), dtype=np.float32)
    advantages[0] = -1.0  # a negative advantage takes the unclipped ratio: -inf before
    logprobs = policy_logprobs()
    reference = torch.full((2, 4), POISON) if objective.kl_coef > 0 else None
    values = torch.zeros(2, 4, requires_grad=True) if isinstance(objective, PpoObjective) else None
    out = objective_loss(
        logprobs,
        batch(objective, old_logprobs=old, advantages=advantages),
        ref_logprobs=reference,
        values=values,
    )
    out.loss.backward()
    assert out.excluded_rows == []
    assert math.isfinite(out.loss.item())
    assert torch.isfinite(logprobs.grad).all()
    assert out.metrics["ratio_mean"] <= math.exp(LOG_RATIO_BOUND) * 1.0001
    assert all(math.isfinite(value) for value in out.metrics.values())


def test_a_ratio_past_the_bound_is_clamped_to_it_and_passes_no_gradient() -> None:
    logprobs = torch.tensor([[0.0, -1.0, -1.0]], requires_grad=True)
    old = np.asarray([[0.0, -1.0 - 30.0, -1.5]], dtype=np.float32)
    tokens = batch(GrpoObjective(clip_low=0.2, clip_high=1e9), rows=1, width=3, old_logprobs=old)
    out = objective_loss(logprobs, tokens)
    out.loss.backward()
    # Token 1: ratio exp(30) clamped to exp(20); token 2: exp(0.5), inside the bound.
    assert out.metrics["ratio_mean"] == pytest.approx((math.exp(20.0) + math.exp(0.5)) / 2, rel=1e-5)
    assert logprobs.grad[0, 1].item() == 0.0
    assert logprobs.grad[0, 2].item() != 0.0


@pytest.mark.parametrize("poison", ["advantage", "old_logprob", "policy_logprob"])
def test_a_row_whose_loss_is_not_finite_is_excluded_and_the_others_train(poison: str) -> None:
    objective = GrpoObjective()
    arrays: dict[str, np.ndarray] = {}
    logprobs = policy_logprobs(rows=3)
    if poison == "advantage":
        advantages = np.ones((3, 4), dtype=np.float32)
        advantages[1, 2] = np.nan
        arrays["advantages"] = advantages
    elif poison == "old_logprob":
        old = np.full((3, 4), -1.0, dtype=np.float32)
        old[1, 3] = np.nan
        arrays["old_logprobs"] = old
    else:
        with torch.no_grad():
            logprobs[1, 1] = float("nan")
    poisoned = batch(objective, rows=3, **arrays)
    out = objective_loss(logprobs, poisoned)
    out.loss.backward()
    assert out.excluded_rows == [1]
    assert torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[1] == 0).all()
    # The other rows' loss, under the update's scale (the excluded row's tokens still count).
    clean = policy_logprobs(rows=2)
    kept = batch(objective, rows=2, loss_scale=poisoned.loss_scale)
    expected = objective_loss(clean, kept)
    assert out.loss.item() == pytest.approx(expected.loss.item())
    assert out.metrics["loss"] == pytest.approx(expected.metrics["loss"])


def test_a_dpo_pair_with_a_non_finite_row_is_excluded_whole() -> None:
    logprobs = torch.tensor([[0.0, -1.0], [0.0, float("nan")], [0.0, -1.0], [0.0, -2.0]], requires_grad=True)
    reference = torch.full((4, 2), -1.5)
    pairs = batch(DpoObjective(), rows=4, width=2, loss_scale=0.5)
    out = objective_loss(logprobs, pairs, ref_logprobs=reference)
    out.loss.backward()
    assert out.excluded_rows == [0, 1]
    assert torch.isfinite(logprobs.grad).all()
    # Pair 1 alone: margin 0.1 * (0.5 - (-0.5)).
    assert out.loss.item() == pytest.approx(0.5 * -math.log(1 / (1 + math.exp(-0.1))), rel=1e-5)


def test_the_hf_policy_steps_on_its_finite_rows_and_never_on_nan(tiny_model_dir: Path) -> None:
    policy = make_policy(tiny_model_dir)
    clean = grpo_batch(policy, GrpoObjective())
    old = clean.old_logprobs.copy()
    old[0][clean.loss_mask[0] > 0] = POISON  # clamped: a finite ratio
    old[2][clean.loss_mask[2] > 0] = np.nan  # excluded
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    metrics = policy.train_step(dataclasses.replace(clean, old_logprobs=old))
    assert metrics["excluded_rows"] == [2]
    assert math.isfinite(metrics["loss"])
    update = policy.apply_update(1e-2)
    assert math.isfinite(update["grad_norm"]) and update["grad_norm"] > 0
    assert "updates_skipped_nonfinite" not in update
    after = policy.trainable_parameters()
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True)), "the step was skipped"


def test_the_hf_policy_skips_a_nan_gradient_and_says_so(tiny_model_dir: Path) -> None:
    policy = make_policy(tiny_model_dir)
    policy.train_step(grpo_batch(policy, GrpoObjective()))
    first = policy.trainable_parameters()[0]
    first.grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    update = policy.apply_update(1e-2)
    assert update["updates_skipped_nonfinite"] == 1.0
    assert "grad_norm" not in update
    after = policy.trainable_parameters()
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert all(p.grad is None for p in after), "the NaN gradient must not carry into the next update"


def test_a_zero_gradient_is_a_counted_skip_not_a_silent_one(tiny_model_dir: Path) -> None:
    policy = make_policy(tiny_model_dir)
    update = policy.apply_update(1e-2)
    assert update["grad_norm"] == 0.0
    assert update["updates_skipped_zero_gradient"] == 1.0


def test_a_nan_on_one_rank_drops_the_update_on_every_rank() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(
            subprocess.Popen([sys.executable, str(WORKER)], env=env, stdout=subprocess.PIPE, text=True)
        )
    outputs = []
    for process in ranks:
        stdout, _ = process.communicate(timeout=120)
        assert process.returncode == 0
        outputs.append(json.loads(stdout))
    # Update 0: both finite. Update 1: rank 1's gradient is NaN. Update 2: rank 0's loss
    # was not finite (its gradient is). Every rank answers the same, every time.
    assert outputs[0]["finite"] == outputs[1]["finite"] == [True, False, False]
    assert outputs[0]["weights_finite"] and outputs[1]["weights_finite"]
    assert outputs[0]["weights"] == outputs[1]["weights"]
