"""Sampling and speculative verification keep the target distribution, row by row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from python_plugins.engine_sampling import RowSampling, propose, verify
from python_plugins.sampling import _truncate

SAMPLES = 40_000
# Expected total-variation distance of 40k samples over 8 tokens is about 0.006.
TOLERANCE = 0.02
TEMPERATURE, TOP_K, TOP_P = 0.8, 6, 0.9
LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0],
        [-1.0, 0.5, 2.5, 1.0, 0.2, 0.1, -2.0, 1.8],
        [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7],
    ]
)


def rows(
    count: int, temperature: float = TEMPERATURE, top_k: int = TOP_K, top_p: float = TOP_P
) -> RowSampling:
    return RowSampling.of(
        np.full(count, temperature, dtype=np.float32),
        np.full(count, top_p, dtype=np.float32),
        np.full(count, top_k, dtype=np.int64),
        torch.device("cpu"),
    )


def target(position: int) -> torch.Tensor:
    """The distribution ``python_plugins.sampling`` samples from at ``position``."""
    truncated = _truncate(LOGITS[position : position + 1] / TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    return torch.softmax(truncated, dim=-1)[0]


def distance(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    return float((counts / counts.sum() - expected.double()).abs().sum() / 2)


def uniforms(count: int, positions: int, seed: int) -> torch.Tensor:
    return torch.rand((count, positions, 3), generator=torch.Generator().manual_seed(seed))


def run(drafts: list[int], seed: int = 0, draft_probs: torch.Tensor | None = None):
    """Verify the same drafts ``SAMPLES`` times with random uniforms."""
    k = len(drafts)
    logits = LOGITS[: k + 1].expand(SAMPLES, -1, -1)
    draft_tokens = torch.tensor(drafts, dtype=torch.long).expand(SAMPLES, -1)
    lens = torch.full((SAMPLES,), k)
    return verify(logits, draft_tokens, lens, rows(SAMPLES), uniforms(SAMPLES, k + 1, seed), draft_probs)


def test_without_drafts_samples_follow_the_truncated_distribution():
    tokens, logprobs, counts = run([])
    assert torch.all(counts == 1)
    assert distance(tokens[:, 0], target(0)) < TOLERANCE
    assert torch.all(target(0)[tokens[:, 0]] > 0)
    full = torch.log_softmax(LOGITS[0] / TEMPERATURE, dim=-1)
    torch.testing.assert_close(logprobs[:, 0], full[tokens[:, 0]])


@pytest.mark.parametrize("draft", [0, 3, 7], ids=["likely", "unlikely", "outside-top-k"])
def test_a_deterministic_draft_keeps_the_target_distribution(draft):
    tokens, _, counts = run([draft])
    assert distance(tokens[:, 0], target(0)) < TOLERANCE
    accepted = counts == 2
    assert float(accepted.double().mean()) == pytest.approx(float(target(0)[draft]), abs=0.01)
    assert torch.all(tokens[accepted, 0] == draft)
    if target(0)[draft] > 0:
        assert distance(tokens[accepted, 1], target(1)) < TOLERANCE


def test_two_deterministic_drafts_keep_the_target_distribution_at_each_position():
    tokens, _, counts = run([0, 2], seed=1)
    assert distance(tokens[:, 0], target(0)) < TOLERANCE
    first_accepted = counts >= 2
    assert distance(tokens[first_accepted, 1], target(1)) < TOLERANCE
    assert distance(tokens[counts == 3, 2], target(2)) < TOLERANCE


def test_drafts_from_a_different_model_keep_the_target_distribution():
    draft_logits = torch.tensor([[0.0, 2.0, 0.5, 1.5, -1.0, 0.3, 2.2, 0.0]]).expand(SAMPLES, -1)
    draft_uniforms = uniforms(SAMPLES, 1, seed=5)[:, 0, 2]
    drafts, draft_probs = propose(draft_logits, rows(SAMPLES), draft_uniforms)
    proposal = draft_probs[0]
    assert distance(drafts, proposal) < TOLERANCE
    assert (proposal - target(0)).abs().sum() > 0.5  # q differs from p

    logits = LOGITS[:2].expand(SAMPLES, -1, -1)
    lens = torch.ones(SAMPLES, dtype=torch.long)
    tokens, _, counts = verify(
        logits, drafts[:, None], lens, rows(SAMPLES), uniforms(SAMPLES, 2, seed=6), draft_probs[:, None]
    )
    assert distance(tokens[:, 0], target(0)) < TOLERANCE
    assert distance(tokens[counts == 2, 1], target(1)) < TOLERANCE
    expected_acceptance = torch.minimum(proposal, target(0)).sum()
    assert float((counts == 2).double().mean()) == pytest.approx(float(expected_acceptance), abs=0.01)


def test_greedy_rows_accept_the_argmax_prefix_and_emit_the_argmax():
    logits = LOGITS.expand(4, -1, -1)  # argmax per position: 0, 2, 7
    drafts = torch.tensor([[0, 2], [0, 5], [1, 2], [0, 2]])
    lens = torch.tensor([2, 2, 2, 1])
    tokens, logprobs, counts = verify(logits, drafts, lens, rows(4, temperature=0.0), uniforms(4, 3, seed=0))
    assert counts.tolist() == [3, 2, 1, 2]
    assert tokens.tolist() == [[0, 2, 7], [0, 2, 0], [0, 0, 0], [0, 2, 0]]
    expected = torch.log_softmax(LOGITS, dim=-1)
    assert logprobs[0].tolist() == pytest.approx([float(expected[i, t]) for i, t in enumerate([0, 2, 7])])
    assert logprobs[1, 2] == 0


def test_a_rows_tokens_depend_only_on_its_own_uniforms():
    count = 6
    logits = torch.randn((count, 3, 8), generator=torch.Generator().manual_seed(0))
    drafts = torch.tensor([[1, 2]] * count)
    lens = torch.tensor([0, 1, 2, 2, 0, 1])
    sampling = RowSampling.of(
        np.asarray([0.7, 1.0, 0.5, 0.0, 1.3, 0.9], dtype=np.float32),
        np.asarray([1.0, 0.8, 0.95, 1.0, 0.6, 1.0], dtype=np.float32),
        np.asarray([0, 3, 0, 2, 5, 0]),
        torch.device("cpu"),
    )
    noise = uniforms(count, 3, seed=3)
    together = verify(logits, drafts, lens, sampling, noise)
    for row in range(count):
        alone = verify(
            logits[row : row + 1],
            drafts[row : row + 1],
            lens[row : row + 1],
            sampling.select(torch.tensor([row])),
            noise[row : row + 1],
        )
        for batched, single in zip(together, alone, strict=True):
            assert batched[row].tolist() == single[0].tolist()
