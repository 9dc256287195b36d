"""End to end: a generation worker that reports a sampled token's logprob as -95 (finite, but
exp(95) overflows float32) cannot poison an update (docs/security.md). Its samples are
excluded and counted, no optimizer step is skipped, no NaN reaches the weights, and the run
goes on: refused by the controller's peer check in a distributed run, left out by the
trainer's own check in one process."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from tests.e2e.harness import FIXTURES, cluster, launch, metrics, run, write_config

STEPS = 3


def poisoning(poison_in: str) -> dict:
    """The tiny HF policy, poisoning logprobs in the process named `poison_in` ("" for all)."""
    return {
        "python": {"paths": [FIXTURES]},
        "policy.plugin": "poisoning_plugins:PoisoningHFCausalLM",
        "policy.options.poison_in": poison_in,
        "sft": None,
        "checkpoint.every": STEPS,
    }


def assert_every_update_applied_and_finite(directory: Path) -> list[dict]:
    """Every step applied its update, with a finite loss and gradient, or counted why not (an
    exactly zero gradient: no sample had an advantage); none was skipped for a NaN; the last
    checkpoint's weights are finite. Returns the metric lines."""
    lines = metrics(directory)
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert [line["weight_version"] for line in lines] == list(range(1, STEPS + 1))
    for line in lines:
        assert math.isfinite(line["loss"]) and math.isfinite(line["grad_norm"]), line
        assert line["grad_norm"] > 0 or line["updates_skipped_zero_gradient"] == 1, line
        assert line["updates_skipped_nonfinite"] == 0, line
        assert line["samples_excluded_nonfinite"] == 0, line
    assert any(line["grad_norm"] > 0 for line in lines), "no update moved the weights"
    weights = (
        directory / "out" / "checkpoints" / f"step-{STEPS:08d}" / "policy" / "model" / "model.safetensors"
    )
    tensors = load_file(str(weights))
    assert tensors and all(np.isfinite(t).all() for t in tensors.values())
    return lines


def test_a_worker_sending_logprobs_of_minus_95_is_refused_and_the_run_goes_on(
    tmp_path: Path, artifacts: Path
) -> None:
    # Two workers, the second poisoning; two data-parallel trainer ranks.
    config = write_config(tmp_path, artifacts, cluster(2, 2, 0), poisoning("worker-1"), steps=STEPS)
    result = launch(config)
    lines = assert_every_update_applied_and_finite(tmp_path)
    refused = sum(line["samples_excluded_malformed"] for line in lines)
    assert refused > 0, "the poisoned samples were not counted"
    assert sum(line["answers_malformed"] for line in lines) >= 1
    assert "sent a malformed answer" in result.stderr and "outside [-80, 0]" in result.stderr
    # What the trainers were sent had passed the peer check: none of it was refused there.
    assert all(line["samples_excluded_invalid"] == 0 for line in lines)
    assert all(line["completions"] == 8 for line in lines), "every group was generated again"


def test_in_one_process_the_trainer_leaves_the_poisoned_samples_out(tmp_path: Path, artifacts: Path) -> None:
    # A KL term trains every sample, whatever its advantage: the poisoned ones reach the
    # trainer, whose own check leaves them out.
    kl = {"algorithm.kl_coef": 0.01}
    config = write_config(tmp_path, artifacts, poisoning(""), kl, steps=STEPS)
    run(config)
    lines = assert_every_update_applied_and_finite(tmp_path)
    assert sum(line["samples_excluded_invalid"] for line in lines) > 0
