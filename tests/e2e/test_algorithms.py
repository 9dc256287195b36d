"""Every algorithm learns, through the binary, on the tiny local model from the same start.

The policy-gradient algorithms raise a reward any tiny model can learn quickly (the share of
7s in a completion); DPO raises its preference accuracy and lowers its loss on addition pairs
(the right answer against one digit changed); SFT lowers its loss. Each run is a few seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import FIXTURES, cluster, launch, mean, metrics, samples, train, write_config

# Each algorithm's own options.
OPTIONS = {
    "reinforce_pp": {"kl_coef": 0.01},
    "dpo": {"beta": 0.5},
    "gspo": {"overlong_buffer": 1, "overlong_penalty": 0.1},
    "ppo": {"critic_warmup_steps": 2, "epochs": 2},
}


def algorithm_config(
    directory: Path, artifacts: Path, algorithm: str, steps: int, overrides: dict | None = None
) -> Path:
    """The base config with `algorithm` and no SFT warm start: the policy-gradient ones raise
    the share of 7s (CharacterShare); DPO trains on addition pairs, SFT on the prompts' answers."""
    policy_gradient = algorithm not in ("dpo", "sft")
    config = {
        "run": {"name": algorithm, "seed": 3},
        "python.paths": [FIXTURES],
        "rewards": [{"plugin": "algorithm_plugins:CharacterShare"}] if policy_gradient else None,
        "algorithm": {"name": algorithm, **OPTIONS.get(algorithm, {})},
        "rollout": {"prompts_per_step": 4 if policy_gradient else 16, "group_size": 8},
        "train": {"learning_rate": 0.01 if policy_gradient else 0.003, "micro_batch_tokens": 512},
        "sft": None,
        "checkpoint.every": 4,
    }
    if algorithm == "dpo":
        config["data.transforms"] = [{"plugin": "python_plugins.data:WrongAnswerPairs"}]
    return write_config(directory, artifacts, config, overrides, steps=steps, filename=f"{algorithm}.toml")


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "ppo"])
def test_policy_gradient_algorithms_raise_the_reward(tmp_path: Path, artifacts: Path, algorithm: str) -> None:
    lines = train(algorithm_config(tmp_path, artifacts, algorithm, steps=14))
    rewards = [line["reward_mean"] for line in lines]
    assert mean(rewards[-4:]) > mean(rewards[:4]) + 0.3, rewards
    if algorithm == "reinforce_pp":
        assert all(line["kl"] >= 0.0 for line in lines) and any(line["kl"] > 0.0 for line in lines)
    if algorithm == "ppo":
        warm_up, trained = lines[:2], lines[2:]
        assert all(line["grad_norm"] == 0.0 and "clip_fraction" not in line for line in warm_up)
        assert all(line["value_grad_norm"] > 0.0 for line in lines)
        # The second epoch of each update moves the values past the clip somewhere.
        assert any(line["value_clip_fraction"] > 0.0 for line in lines)
        # The critic follows the returns as the reward rises.
        assert all(abs(line["value_mean"] - line["returns_mean"]) < 0.15 for line in trained[-4:]), trained


def test_ppo_resumes_exactly_with_its_value_head(tmp_path: Path, artifacts: Path) -> None:
    config = algorithm_config(tmp_path, artifacts, "ppo", steps=6)
    uninterrupted = train(config)
    train(config, "--overwrite", "--set", "run.steps=4")
    checkpoint = tmp_path / "out" / "checkpoints" / "step-00000004" / "policy"
    assert (checkpoint / "value_head" / "weights.safetensors").exists()
    resumed = train(config, "--resume")
    keys = ("reward_mean", "loss", "value_loss", "value_mean", "grad_norm")
    signal = [[line[k] for k in keys] for line in uninterrupted]
    assert [[line[k] for k in keys] for line in resumed] == signal


def test_dpo_learns_to_prefer_the_right_answers(tmp_path: Path, artifacts: Path) -> None:
    lines = train(algorithm_config(tmp_path, artifacts, "dpo", steps=16))
    losses = [line["loss"] for line in lines]
    accuracy = [line["reward_accuracy"] for line in lines]
    assert losses[0] == pytest.approx(0.6931, abs=1e-3), "the policy starts as its reference"
    assert mean(losses[-4:]) < losses[0] - 0.15, losses
    assert mean(accuracy[-4:]) > 0.75, accuracy
    assert all(line["micro_batches"] >= 1 and "reward_margin" in line for line in lines)


def test_sft_lowers_the_loss_and_resumes_exactly(tmp_path: Path, artifacts: Path) -> None:
    config = algorithm_config(tmp_path, artifacts, "sft", steps=8)
    uninterrupted = train(config)
    assert uninterrupted[-1]["loss"] < 0.8 * uninterrupted[0]["loss"]
    train(config, "--overwrite", "--set", "run.steps=4")
    resumed = train(config, "--resume")
    assert [line["step"] for line in resumed] == list(range(1, 9))
    assert [line["loss"] for line in resumed] == [line["loss"] for line in uninterrupted]


def test_ppo_on_two_trainer_ranks_matches_one_process(tmp_path: Path, artifacts: Path) -> None:
    local_dir, cluster_dir = tmp_path / "local", tmp_path / "cluster"
    local_dir.mkdir()
    cluster_dir.mkdir()
    local = train(algorithm_config(local_dir, artifacts, "ppo", steps=4))
    # Two trainer ranks, one of them dealt no micro-batch: it still builds the value head.
    launch(algorithm_config(cluster_dir, artifacts, "ppo", steps=4, overrides=cluster(1, 2, 0)))
    remote = metrics(cluster_dir)
    assert [line["step"] for line in remote] == [1, 2, 3, 4]
    for there, here in zip(remote, local, strict=True):
        assert there["reward_mean"] == here["reward_mean"]
        for key in ("value_loss", "value_mean", "grad_norm", "value_grad_norm"):
            assert there[key] == pytest.approx(here[key], rel=1e-3, abs=1e-6), key


def test_dynamic_sampling_refills_flat_groups(tmp_path: Path, artifacts: Path) -> None:
    # Exact answers are rare for the untrained model: most groups score all zeros.
    overrides = {
        "run.log_samples": 1000,
        "rewards": [{"plugin": "python_plugins.rewards:ExactMatch"}],
        "algorithm.dynamic_sampling_rounds": 2,
    }
    config = algorithm_config(tmp_path, artifacts, "grpo", steps=4, overrides=overrides)
    uninterrupted = train(config)
    assert sum(line["refilled_groups"] for line in uninterrupted) > 0, uninterrupted
    assert all(0 <= line["refill_rounds"] <= 2 for line in uninterrupted)
    logged = samples(tmp_path)
    for step in range(1, 5):
        groups = {sample["group"] for sample in logged if sample["step"] == step}
        # Every step trains prompts_per_step groups; refills are numbered after the first round.
        assert len(groups) == 4, groups
    assert any(sample["group"] >= 4 for sample in logged)
    keys = ("reward_mean", "loss", "refilled_groups", "zero_std_group_fraction")
    signal = [[line[k] for k in keys] for line in uninterrupted]
    train(config, "--overwrite", "--set", "run.steps=2")
    resumed = train(config, "--resume")
    assert [[line[k] for k in keys] for line in resumed] == signal
