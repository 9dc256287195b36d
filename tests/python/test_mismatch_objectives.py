"""The training/inference mismatch metrics and the rollout correction (TIS, MIS) of
rollout_sdk/objectives.py: hand-computed values, then a deliberately mismatched generator
(sampling at a temperature the trainer does not know about) through the HF policy."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_sdk import GrpoObjective, GspoObjective, SamplingParams, TrainBatch
from rollout_sdk.objectives import first_evaluation_logprobs, mismatch_metrics, objective_loss
from tests.python.policy_helpers import make_policy, requests, right_padded

LN2, LN3 = math.log(2.0), math.log(3.0)


def batch(generator: list[list[float]], objective, staleness=None, first=None) -> TrainBatch:
    """Rows of 1 + len(tokens) positions (column 0 is the prompt), advantage 1 everywhere."""
    width = 1 + max(len(row) for row in generator)
    old = np.zeros((len(generator), width), dtype=np.float32)
    mask = np.zeros_like(old)
    for r, row in enumerate(generator):
        old[r, 1 : 1 + len(row)] = row
        mask[r, 1 : 1 + len(row)] = 1.0
    return TrainBatch(
        input_ids=np.ones(old.shape, dtype=np.int64),
        attention_mask=np.ones(old.shape, dtype=np.int64),
        loss_mask=mask,
        advantages=mask.copy(),
        old_logprobs=old,
        loss_scale=1.0,
        objective=objective,
        row_staleness=None if staleness is None else np.asarray(staleness, dtype=np.int64),
        first_logprobs=first,
    )


def test_mismatch_sums_keep_on_version_rows_apart_from_stale_ones() -> None:
    # Trainer logprobs 0 everywhere: d = -generator. Row 0 (on version): d = 0, ln 2; row 1
    # (two versions old): d = -ln 2.
    train = batch([[0.0, -LN2], [LN2]], GrpoObjective(), staleness=[0, 2])
    logprobs = torch.zeros(train.old_logprobs.shape)
    metrics = mismatch_metrics(logprobs, train, torch.as_tensor(train.loss_mask))
    assert metrics["mismatch/tokens"] == 2.0
    assert metrics["mismatch/k3_sum"] == pytest.approx(2.0 - 1.0 - LN2)
    assert metrics["mismatch/ratio_sum"] == pytest.approx(3.0)
    assert metrics["mismatch/outside_tokens"] == 1.0  # 2 > 1.25
    assert (metrics["mismatch/ratio_min"], metrics["mismatch/ratio_max"]) == pytest.approx((1.0, 2.0))
    assert metrics["stale/tokens"] == 1.0
    assert metrics["stale/k3_sum"] == pytest.approx(0.5 - 1.0 + LN2)
    assert metrics["stale/outside_tokens"] == 1.0  # 0.5 < 0.8


def test_without_row_staleness_every_row_is_on_version_and_matched_logprobs_measure_zero() -> None:
    train = batch([[-0.3, -1.2]], GrpoObjective())
    logprobs = torch.as_tensor(train.old_logprobs)
    metrics = objective_loss(logprobs, train).metrics
    assert metrics["mismatch/tokens"] == 2.0 and "stale/tokens" not in metrics
    assert metrics["mismatch/k3_sum"] == 0.0 and metrics["mismatch/outside_tokens"] == 0.0


def test_tis_weights_each_tokens_loss_by_the_truncated_ratio() -> None:
    # First evaluation: the trainer's logprobs are 0, so the PPO ratio is 1 and each token's
    # loss is -advantage * w with w = min(exp(0 - generator), 2) = min(3, 2), min(0.5, 2).
    train = batch([[-LN3, LN2]], GrpoObjective(rollout_correction="tis", rollout_correction_cap=2.0))
    logprobs = torch.zeros(train.old_logprobs.shape, requires_grad=True)
    output = objective_loss(logprobs, train)
    assert float(output.loss.detach()) == pytest.approx(-2.5)
    output.loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0, 1:].tolist() == pytest.approx([-2.0, -0.5])
    assert output.metrics["correction/truncated_fraction"] == 0.5
    assert output.metrics["correction/weight_mean"] == pytest.approx(1.25)
    assert output.metrics["ratio_mean"] == pytest.approx(1.0)


def test_without_correction_the_ratio_is_against_the_generator_as_before() -> None:
    train = batch([[-LN3, LN2]], GrpoObjective(clip_low=10.0, clip_high=10.0))
    logprobs = torch.zeros(train.old_logprobs.shape, requires_grad=True)
    output = objective_loss(logprobs, train)
    # ratio = exp(0 - generator) = 3, 0.5; no weight.
    assert output.metrics["ratio_mean"] == pytest.approx(1.75)
    assert not any(name.startswith("correction/") for name in output.metrics)
    assert first_evaluation_logprobs(logprobs, train) is None


def test_decoupled_ratio_uses_the_first_evaluation_logprobs_in_later_epochs() -> None:
    objective = GrpoObjective(
        rollout_correction="tis", rollout_correction_cap=10.0, clip_low=10.0, clip_high=10.0
    )
    first = np.zeros((1, 3), dtype=np.float32)
    train = batch([[-LN3, LN2]], objective)
    logprobs = torch.full(train.old_logprobs.shape, LN2)
    handed_back = first_evaluation_logprobs(logprobs, train)
    assert handed_back is not None and handed_back[0].tolist() == pytest.approx([LN2] * 3)
    later = dataclasses.replace(train, first_logprobs=first)
    output = objective_loss(logprobs, later)
    # ratio = exp(ln 2 - 0) = 2 for both tokens; w = exp(0 - generator) = 3, 0.5.
    assert output.metrics["ratio_mean"] == pytest.approx(2.0)
    assert float(output.loss.detach()) == pytest.approx(-(2.0 * 3.0 + 2.0 * 0.5))
    assert first_evaluation_logprobs(logprobs, later) is None


def test_token_mis_masks_tokens_outside_the_band() -> None:
    # w = 3, 0.8, 0.25: only 0.8 is in [0.5, 2].
    objective = GrpoObjective(rollout_correction="mis", rollout_correction_band=(0.5, 2.0))
    train = batch([[-LN3, math.log(1.25), math.log(4.0)]], objective)
    logprobs = torch.zeros(train.old_logprobs.shape, requires_grad=True)
    output = objective_loss(logprobs, train)
    assert float(output.loss.detach()) == pytest.approx(-1.0)
    output.loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0, 1:].tolist() == pytest.approx([0.0, -1.0, 0.0])
    assert output.metrics["correction/masked_fraction"] == pytest.approx(2.0 / 3.0)


def test_sequence_mis_keeps_or_masks_whole_sequences_by_their_geometric_mean() -> None:
    objective = GspoObjective(
        rollout_correction="mis", rollout_correction_band=(0.5, 2.0), rollout_correction_level="sequence"
    )
    # Row 0: w = 3, 0.8, 0.25, geometric mean 0.6^(1/3) = 0.84: kept whole. Row 1: w = 3, 3:
    # masked whole.
    train = batch([[-LN3, math.log(1.25), math.log(4.0)], [-LN3, -LN3]], objective)
    output = objective_loss(torch.zeros(train.old_logprobs.shape), train)
    assert output.metrics["correction/masked_fraction"] == pytest.approx(2.0 / 5.0)
    assert output.metrics["correction/weight_mean"] == pytest.approx(3.0 / 5.0)
    assert float(output.loss.detach()) == pytest.approx(-3.0)


# A deliberately mismatched generator: the HF policy samples at a temperature the objective
# does not know about.

TRAIN_TEMPERATURE = 1.0


def sampled_batch(policy, generator_temperature: float, objective) -> TrainBatch:
    """Completions sampled (and their logprobs taken) at `generator_temperature`."""
    reqs = requests(policy, n=4)
    params = SamplingParams(max_new_tokens=12, temperature=generator_temperature, seed=3)
    generations = [g for group in policy.generate(reqs, params) for g in group]
    prompts = [[int(t) for t in r.prompt_ids] for r in reqs for _ in range(r.n)]
    sequences = [p + [int(t) for t in g.token_ids] for p, g in zip(prompts, generations, strict=True)]
    ids, attention = right_padded(sequences)
    old = np.zeros(ids.shape, dtype=np.float32)
    mask = np.zeros_like(old)
    for row, (prompt, generation) in enumerate(zip(prompts, generations, strict=True)):
        span = slice(len(prompt), len(prompt) + len(generation.token_ids))
        old[row, span] = generation.logprobs
        mask[row, span] = 1.0
    advantages = np.where(np.arange(len(sequences))[:, None] % 2 == 0, 1.0, -1.0).astype(np.float32) * mask
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=mask,
        advantages=advantages,
        old_logprobs=old,
        loss_scale=1.0 / float(mask.sum()),
        objective=objective,
        row_staleness=np.zeros(len(sequences), dtype=np.int64),
    )


def gradient(policy, train: TrainBatch) -> tuple[dict, torch.Tensor]:
    """The metrics of one `train_step` and the flat gradient it accumulated (then cleared)."""
    metrics = policy.train_step(train)
    parameters = policy.trainable_parameters()
    flat = torch.cat([p.grad.flatten().clone() for p in parameters if p.grad is not None])
    for p in parameters:
        p.grad = None
    return metrics, flat


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path):
    return make_policy(tiny_model_dir, dtype="float32")


def test_a_mismatched_generator_raises_the_mismatch_metrics(policy) -> None:
    objective = GrpoObjective(temperature=TRAIN_TEMPERATURE)
    matched, _ = gradient(policy, sampled_batch(policy, TRAIN_TEMPERATURE, objective))
    mismatched, _ = gradient(policy, sampled_batch(policy, 1.6, objective))

    def kl(metrics: dict) -> float:
        return metrics["mismatch/k3_sum"] / metrics["mismatch/tokens"]

    def outside(metrics: dict) -> float:
        return metrics["mismatch/outside_tokens"] / metrics["mismatch/tokens"]

    # float32, the same temperature: the trainer computes exactly the generator's logprobs.
    assert kl(matched) < 1e-6 and outside(matched) == 0.0
    assert matched["mismatch/ratio_min"] > 0.999 and matched["mismatch/ratio_max"] < 1.001
    # The tiny random model is nearly uniform, so 1.6 moves each ratio by about 10%...
    assert kl(mismatched) > 100 * max(kl(matched), 1e-6)
    assert mismatched["mismatch/ratio_min"] < 0.9 and mismatched["mismatch/ratio_max"] > 1.1
    # ...and a sharper generator (0.3) puts many tokens outside [0.8, 1.25].
    sharp, _ = gradient(policy, sampled_batch(policy, 0.3, objective))
    assert kl(sharp) > kl(mismatched) and outside(sharp) > 0.1


def test_the_rollout_correction_changes_the_update_of_a_mismatched_batch(policy) -> None:
    plain = sampled_batch(policy, 1.6, GrpoObjective(temperature=TRAIN_TEMPERATURE))
    _, none = gradient(policy, plain)
    truncated = GrpoObjective(rollout_correction="tis", rollout_correction_cap=1.0)
    tis, tis_gradient = gradient(policy, dataclasses.replace(plain, objective=truncated))
    mis, mis_gradient = gradient(
        policy,
        dataclasses.replace(
            plain, objective=GrpoObjective(rollout_correction="mis", rollout_correction_band=(0.95, 1.05))
        ),
    )
    # Cap 1: every token whose trainer probability exceeds the generator's is truncated.
    assert tis["correction/truncated_fraction"] > 0.0
    assert tis["correction/weight_mean"] <= 1.0
    assert "first_logprobs" in tis and tis["first_logprobs"].shape == plain.old_logprobs.shape
    assert mis["correction/masked_fraction"] > 0.1
    assert mis["correction/weight_mean"] == pytest.approx(1.0 - mis["correction/masked_fraction"])
    for corrected in (tis_gradient, mis_gradient):
        assert not torch.allclose(corrected, none, rtol=1e-3, atol=1e-7)
