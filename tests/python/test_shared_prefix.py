"""Training passes that run each group's prompt once give the plain passes' logprobs and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from policy_helpers import make_policy, right_padded

from python_plugins import prefix_rows
from python_plugins.prefix_rows import prefix_rows_mask
from python_plugins.shared_prefix import plan_shared_prefixes, shared_prefix_logprobs
from python_plugins.suffix_packing import packed_suffix_mask, packs_suffixes
from rollout_sdk import GrpoObjective, TrainBatch

CPU = torch.device("cpu")


def group_batch(
    prompts: list[list[int]], completions: list[list[list[int]]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded rows prompt + completion, with the completion tokens loss-masked."""
    rows = [(p, c) for p, group in zip(prompts, completions, strict=True) for c in group]
    ids, attention = right_padded([p + c for p, c in rows])
    loss = np.zeros(ids.shape, dtype=np.float32)
    for row, (p, c) in enumerate(rows):
        loss[row, len(p) : len(p) + len(c)] = 1
    return ids, attention, loss


def random_groups(seed: int, groups: int = 3, group_size: int = 4) -> tuple[list, list]:
    """Prompts of 6 to 11 tokens, completions of 1 to 5; the second row's has 5."""
    rng = np.random.default_rng(seed)
    prompts = [[1, *rng.integers(3, 40, size=int(rng.integers(5, 11))).tolist()] for _ in range(groups)]
    completions = [
        [rng.integers(3, 40, size=int(rng.integers(1, 6))).tolist() for _ in range(group_size)]
        for _ in range(groups)
    ]
    completions[0][1] = rng.integers(3, 40, size=5).tolist()
    return prompts, completions


def test_the_plan_shares_identical_prompts_and_keeps_every_token() -> None:
    prompts = [[1, 5, 6], [1, 7, 8, 9, 10]]
    completions = [[[11], [12, 13, 14]], [[15, 16], [17]]]
    ids, attention, loss = group_batch(prompts, completions)
    plan = plan_shared_prefixes(ids, attention, loss)
    assert plan is not None
    assert plan.row_prefix.tolist() == [0, 0, 1, 1]
    # Left-padded prompts: each ends in the last column.
    assert plan.prefix_ids.tolist() == [[0, 0, 1, 5, 6], [1, 7, 8, 9, 10]]
    assert plan.prefix_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert plan.suffix_ids.tolist() == [[11, 0, 0], [12, 13, 14], [15, 16, 0], [17, 0, 0]]
    assert plan.suffix_positions[:, 0].tolist() == [3, 3, 5, 5]
    assert plan.positions < ids.size
    assert plan.bins is None


def test_suffixes_of_one_prefix_share_rows_as_long_as_the_longest(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[1, 5, 6], [1, 7, 8, 9, 10]]
    completions = [[[11], [12, 13, 14]], [[15, 16], [17]]]
    ids, attention, loss = group_batch(prompts, completions)
    monkeypatch.setattr(prefix_rows, "MAX_WIDTH", 0)  # two passes
    plan = plan_shared_prefixes(ids, attention, loss, pack_suffixes=True)
    assert plan is not None and plan.bins is not None
    bins = plan.bins
    # The 3-token suffix fills a row; the 1-token one of the same prompt gets its own; the
    # second prompt's two fit in one.
    assert (bins.capacity, bins.bin_prefix.tolist()) == (3, [0, 0, 1])
    assert (bins.row_bin.tolist(), bins.row_offset.tolist()) == ([1, 0, 2, 2], [0, 0, 0, 2])
    lengths = plan.suffix_mask.sum(axis=1)
    assert bins.packed(plan.suffix_ids, lengths).tolist() == [[12, 13, 14], [11, 0, 0], [15, 16, 17]]
    assert bins.segments(lengths).tolist() == [[1, 1, 1], [0, -1, -1], [2, 2, 3]]
    assert plan.one_pass is None and plan.positions == 2 * 5 + 3 * 3
    mask = packed_suffix_mask(
        torch.as_tensor(bins.segments(lengths)), torch.as_tensor(plan.prefix_mask)[[0, 0, 1]]
    )
    # Row 3's token (bin 2, column 2) sees the second prompt and itself, not row 2's suffix.
    assert mask[2, 0, 2].tolist() == [True] * 5 + [False, False, True]
    # Row 2's second token sees the prompt and its first token; padding sees only itself.
    assert mask[2, 0, 1].tolist() == [True] * 5 + [True, True, False]
    assert mask[1, 0, 1].tolist() == [False] * 5 + [False, True, False]
    assert mask[0, 0, 0].tolist() == [False, False] + [True] * 3 + [True, False, False]


def test_one_pass_puts_each_prompt_and_its_completions_in_a_row() -> None:
    prompts = [[1, 5, 6], [1, 7, 8, 9, 10]]
    completions = [[[11], [12, 13, 14]], [[15, 16], [17]]]
    ids, attention, loss = group_batch(prompts, completions)
    plan = plan_shared_prefixes(ids, attention, loss, pack_suffixes=True)
    assert plan is not None and plan.one_pass is not None and plan.bins is None
    assert plan.positions == 2 * 6
    rows = plan.one_pass
    # A completion's last token predicts nothing, so no row holds it: [11] and [17] add no input.
    assert rows.ids.tolist() == [[1, 5, 6, 12, 13, 0], [1, 7, 8, 9, 10, 15]]
    # Every completion's positions continue its prompt.
    assert rows.positions.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 5]]
    assert rows.segments.tolist() == [[-1, -1, -1, 1, 1, -2], [-1] * 5 + [2]]
    # 11 and 12 follow the first prompt's last token; 15 and 17 the second's, 16 follows 15.
    assert rows.source.tolist() == [2, 2, 3, 4, 10, 11, 10]
    mask = prefix_rows_mask(torch.as_tensor(rows.segments))[:, 0]
    assert mask[0, 4].tolist() == [True] * 5 + [False]
    assert mask[1, 5].tolist() == [True] * 6
    assert mask[0, 2].tolist() == [True] * 3 + [False] * 3
    assert mask[0, 5].tolist() == [False] * 5 + [True]


def test_one_pass_is_left_for_rows_too_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    ids, attention, loss = group_batch(
        [[1, 5, 6], [1, 7, 8, 9, 10]], [[[11], [12, 13, 14]], [[15, 16], [17]]]
    )
    monkeypatch.setattr(prefix_rows, "MAX_WIDTH", 5)
    plan = plan_shared_prefixes(ids, attention, loss, pack_suffixes=True)
    assert plan is not None and plan.one_pass is None and plan.bins is not None


def test_suffixes_are_not_packed_when_that_saves_little() -> None:
    ids, attention, loss = group_batch([[1, 5, 6, 7, 8, 9]], [[[11, 12], [13, 14], [15]]])
    plan = plan_shared_prefixes(ids, attention, loss, pack_suffixes=True)
    assert plan is not None and plan.bins is None


def test_no_plan_when_nothing_is_shared() -> None:
    ids, attention, loss = group_batch([[1, 5], [1, 6], [1, 7]], [[[8, 9, 10]], [[11, 12]], [[13]]])
    assert plan_shared_prefixes(ids, attention, loss) is None


def test_no_plan_for_a_row_without_trained_tokens() -> None:
    prompts, completions = random_groups(0)
    ids, attention, loss = group_batch(prompts, completions)
    loss[2] = 0
    assert plan_shared_prefixes(ids, attention, loss) is None


@pytest.mark.parametrize("layout", ["padded", "bins", "one pass"])
@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_gpt2_dir", "tiny_gqa_dir"])
def test_logprobs_and_gradients_match_the_plain_pass(
    model: str, layout: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if layout == "bins":
        monkeypatch.setattr(prefix_rows, "MAX_WIDTH", 0)
    pack = layout != "padded"
    policy = make_policy(request.getfixturevalue(model))
    prompts, completions = random_groups(1)
    ids, attention, loss = group_batch(prompts, completions)
    # A multi-turn row: an environment's tokens (not trained) between two generated spans.
    start = len(prompts[0])
    loss[1, start + 2 : start + 4] = 0
    pack_suffixes = pack and packs_suffixes(policy.model.config)
    plan = plan_shared_prefixes(ids, attention, loss, pack_suffixes=pack_suffixes)
    assert plan is not None
    assert (plan.bins is not None) == (pack_suffixes and layout == "bins")
    assert (plan.one_pass is not None) == (pack_suffixes and layout == "one pass")
    mask = torch.as_tensor(loss)

    def logprobs_and_grads(shared: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        policy.model.zero_grad(set_to_none=True)
        if shared:
            logprobs = shared_prefix_logprobs(policy.model, plan, 0.7, CPU)
        else:
            input_ids, attention_mask = torch.as_tensor(ids), torch.as_tensor(attention)
            logprobs = policy._token_logprobs(policy.model, input_ids, attention_mask, 0.7)
        (logprobs * mask * torch.linspace(-1, 1, mask.numel()).view(mask.shape)).sum().backward()
        return logprobs.detach() * mask, [p.grad.clone() for p in policy.model.parameters()]

    shared, shared_grads = logprobs_and_grads(True)
    plain, plain_grads = logprobs_and_grads(False)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert (shared != 0).sum() == mask.sum()
    for a, b in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_train_step_is_the_same_with_and_without_sharing(tiny_model_dir) -> None:
    """Also with gradient checkpointing, which turns the model's cache off (so no sharing)."""
    prompts, completions = random_groups(2)
    ids, attention, loss = group_batch(prompts, completions)
    rng = np.random.default_rng(3)
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss,
        advantages=np.repeat(rng.standard_normal((ids.shape[0], 1)), ids.shape[1], axis=1).astype(np.float32),
        old_logprobs=np.full(ids.shape, -3.0, dtype=np.float32),
        loss_scale=float(1.0 / loss.sum()),
        objective=GrpoObjective(clip_low=0.2, clip_high=0.2, kl_coef=0.1, temperature=1.0),
    )
    results = []
    for options in ({}, {"share_prompt_prefix": False}, {"gradient_checkpointing": True}):
        policy = make_policy(tiny_model_dir, **options)
        metrics = policy.train_step(batch)
        grads = [p.grad.clone() for p in policy.model.parameters()]
        results.append((metrics, grads))
    (shared_metrics, shared_grads), *others = results
    for metrics, grads in others:
        for key in ("loss", "kl", "ratio_mean", "clip_fraction"):
            assert shared_metrics[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6)
        for a, b in zip(shared_grads, grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
