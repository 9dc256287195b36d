"""End to end: RLHF with a learned reward model as the only reward.

The demo reward model (python -m python_plugins.reward_models create-demo) prefers completions
that contain the digit 7; an untrained tiny Llama with the same character tokenizer learns,
through `rollout run` and nothing but the reward model's scores, to write 7s. Then the same
run with the reward model in a sandbox process scores the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from python_plugins.reward_models import create_demo_reward_model, has_demo_property
from tests.e2e.harness import mean, read_jsonl, run, write_config

STEPS = 20
WINDOW = 5  # steps averaged at the start and at the end
METRIC = "reward/reward_model"


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("rlhf") / "reward_model"
    create_demo_reward_model(directory, seed=0)
    return directory


def rlhf_config(directory: Path, artifacts: Path, reward_model: Path, *overrides: dict, steps: int) -> Path:
    """The base config (without its name, SFT warm start and checkpoints) scored by the
    reward model alone."""
    reward = {
        "plugin": "python_plugins.reward_models:SequenceClassifierReward",
        "name": "reward_model",
        "options": {"model_path": reward_model, "normalize": "sigmoid", "batch_size": 32, "torch_threads": 1},
    }
    rlhf = {
        "run": {"name": None, "seed": 1, "log_samples": 1000},
        "rewards": [reward],
        "rollout": {"prompts_per_step": 4, "group_size": 8},
        "train": {"learning_rate": 0.01, "micro_batch_tokens": None},
        "sft": None,
        "checkpoint": None,
    }
    return write_config(directory, artifacts, rlhf, *overrides, steps=steps, filename="rlhf.toml")


@pytest.fixture(scope="module")
def in_process(artifacts: Path, reward_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("in_process")
    run(rlhf_config(directory, artifacts, reward_model, steps=STEPS))
    return directory / "out"


def test_the_reward_model_alone_teaches_the_policy_what_it_prefers(in_process: Path) -> None:
    metrics = read_jsonl(in_process / "metrics.jsonl")
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    scores = [line[METRIC] for line in metrics]
    first, last = mean(scores[:WINDOW]), mean(scores[-WINDOW:])
    print(f"mean reward-model score: first {WINDOW} steps {first:.3f}, last {WINDOW} steps {last:.3f}")
    assert last - first > 0.4 and last > 0.7, scores
    # The preference is real, not a blind spot of the reward model: the completions do have 7s.
    samples = read_jsonl(in_process / "samples.jsonl")
    share = [
        mean([float(has_demo_property(s["completion"])) for s in samples if s["step"] == step])
        for step in range(1, STEPS + 1)
    ]
    first, last = mean(share[:WINDOW]), mean(share[-WINDOW:])
    print(f"completions with a 7: first {WINDOW} steps {first:.3f}, last {WINDOW} steps {last:.3f}")
    assert last - first > 0.4, share


def test_the_reward_model_scores_the_same_in_a_sandbox_process(
    artifacts: Path, reward_model: Path, in_process: Path, tmp_path: Path
) -> None:
    run(rlhf_config(tmp_path, artifacts, reward_model, {"sandbox.processes": 1}, steps=2))
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [line["step"] for line in metrics] == [1, 2]
    assert all(line["reward_failed"] == 0 and line["completions"] == 32 for line in metrics)
    # Step 1 samples the same completions as the in-process run; one sample per call in the
    # sandbox scores them as the batches of 32 did in the embedded interpreter.
    reference = read_jsonl(in_process / "metrics.jsonl")[0]
    assert metrics[0][METRIC] == pytest.approx(reference[METRIC], abs=1e-5)
    samples = read_jsonl(tmp_path / "out" / "samples.jsonl")
    assert all(s["failed"] is None for s in samples)
