"""Rows that are the same token for token run once, with the logprobs and gradients of running each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from policy_helpers import make_policy, right_padded

from python_plugins.distinct_rows import distinct_rows
from rollout_sdk import GrpoObjective, PpoObjective, SftObjective, TrainBatch


def batch_of(rows: list[tuple[list[int], list[int]]], objective) -> TrainBatch:
    """Right-padded prompt + completion rows, completions trained, advantages all different."""
    ids, attention = right_padded([p + c for p, c in rows])
    loss = np.zeros(ids.shape, dtype=np.float32)
    for row, (p, c) in enumerate(rows):
        loss[row, len(p) : len(p) + len(c)] = 1
    advantages = np.linspace(-1.0, 1.5, len(rows), dtype=np.float32)[:, None] * loss
    ppo = isinstance(objective, PpoObjective)
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss,
        advantages=advantages,
        old_logprobs=np.full(ids.shape, -3.0, dtype=np.float32) * loss,
        loss_scale=float(1.0 / loss.sum()),
        objective=objective,
        returns=(np.linspace(2.0, -0.5, len(rows), dtype=np.float32)[:, None] * loss) if ppo else None,
        old_values=np.full(ids.shape, 0.1, dtype=np.float32) * loss if ppo else None,
    )


def perturbed_value_head(policy) -> torch.nn.Module:
    """The policy's value head with a seeded output layer, so its values differ from row to row
    (a new head predicts exactly 0)."""
    module = policy._value_head().module
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        module[-1].weight.copy_(torch.randn(module[-1].weight.shape, generator=generator))
    return module


def test_copies_are_found_in_batch_order() -> None:
    ids, attention = right_padded([[5, 6, 7], [5, 6, 8], [5, 6, 7], [9], [5, 6, 8], [5, 6, 7]])
    loss = (attention * (np.arange(3) >= 2)).astype(np.float32)
    found = distinct_rows(ids, attention, loss)
    assert found is not None
    assert found.first.tolist() == [0, 1, 3]
    assert found.copy_of.tolist() == [0, 1, 0, 2, 1, 0]
    assert found.take(ids).tolist() == [[5, 6, 7], [5, 6, 8], [9, 0, 0]]
    spread = found.spread(torch.tensor([[1.0], [2.0], [3.0]]))
    assert spread[:, 0].tolist() == [1.0, 2.0, 1.0, 3.0, 2.0, 1.0]


def test_rows_differ_by_their_tokens_mask_or_trained_tokens_but_not_their_padding() -> None:
    ids, attention = right_padded([[5, 6], [5, 6, 7], [5, 6]])
    ids[2, 2] = 9  # behind row 2's mask: row 2 is still [5, 6]
    loss = attention.astype(np.float32)
    found = distinct_rows(ids, attention, loss)
    assert found is not None and found.copy_of.tolist() == [0, 1, 0]
    loss[2, 0] = 0  # the same tokens, another share of them trained
    assert distinct_rows(ids, attention, loss) is None


PROMPTS = [[1, 11, 12, 13, 14, 15], [1, 21, 22, 23]]
# Each group's samples partly alike, as short answers come out: 8 rows, 5 distinct.
ROWS = [
    (PROMPTS[0], [30, 31]),
    (PROMPTS[0], [30, 31]),
    (PROMPTS[0], [32, 33, 34]),
    (PROMPTS[0], [30, 31]),
    (PROMPTS[1], [35]),
    (PROMPTS[1], [36, 37, 38, 39]),
    (PROMPTS[1], [35]),
    (PROMPTS[1], [36, 37]),
]


@pytest.mark.parametrize("share", [True, False], ids=["shared_prompts", "plain"])
@pytest.mark.parametrize(
    "objective",
    [GrpoObjective(kl_coef=0.1, temperature=0.7), SftObjective(), PpoObjective(kl_coef=0.1)],
    ids=["grpo_kl", "sft", "ppo_kl"],
)
def test_train_step_with_copies_run_once_equals_every_row_run(tiny_model_dir, share: bool, objective) -> None:
    batch = batch_of(ROWS, objective)
    found = distinct_rows(batch.input_ids, batch.attention_mask, batch.loss_mask)
    assert found is not None and len(found.first) == 5
    positions_run: list[int] = []

    def step(dedupe: bool):
        policy = make_policy(tiny_model_dir, share_prompt_prefix=share, share_identical_rows=dedupe)
        head = policy._output_head(policy.model)
        assert head is not None

        def count(_module, _args, kwargs):
            positions_run.append(int(kwargs["input_ids"].numel()))

        hook = head.decoder.register_forward_pre_hook(count, with_kwargs=True)
        value_head = perturbed_value_head(policy) if isinstance(objective, PpoObjective) else None
        metrics = policy.train_step(batch)
        hook.remove()
        trained = [*policy.model.parameters(), *(value_head.parameters() if value_head else [])]
        return metrics, [p.grad.clone() for p in trained if p.grad is not None]

    once, once_grads = step(dedupe=True)
    distinct_positions = sum(positions_run)
    positions_run.clear()
    every, every_grads = step(dedupe=False)
    assert 0 < distinct_positions < sum(positions_run)
    for key in ("loss", "ratio_mean", "clip_fraction", "kl", "value_loss", "value_mean"):
        if key in every:
            assert once[key] == pytest.approx(every[key], rel=1e-5, abs=1e-7)
    assert len(once_grads) == len(every_grads)
    for a, b in zip(once_grads, every_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_values_with_copies_run_once_equal_every_row_run(tiny_model_dir) -> None:
    batch = batch_of(ROWS, PpoObjective())
    values = {}
    for dedupe in (True, False):
        policy = make_policy(tiny_model_dir, share_identical_rows=dedupe)
        perturbed_value_head(policy)
        values[dedupe] = policy.values(batch)
    assert values[False].shape == batch.input_ids.shape
    assert len({row.tobytes() for row in values[False]}) == 5  # one set of values per distinct row
    np.testing.assert_allclose(values[True], values[False], rtol=1e-5, atol=1e-6)
