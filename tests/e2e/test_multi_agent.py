"""Multi-agent runs through the binary: a proposer and a solver, each its own copy of the tiny
model with its own optimizer and checkpoint, learn together in ProposerSolver."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.numpy import load_file

from tests.e2e.harness import mean, rollout, samples, train, write_config

AGENTS = ("proposer", "solver")


def multi_agent_config(directory: Path, artifacts: Path, *overrides: dict, steps: int) -> Path:
    """The base config as ProposerSolver's two agents (the solver with its own learning rate),
    rewarded by the environment alone, with no SFT warm start."""
    multi_agent = {
        "run": {"name": "multi-agent", "seed": 3, "log_samples": 4},
        "agents": {"proposer": {}, "solver": {"learning_rate": 0.02}},
        "environment": {"plugin": "python_plugins.multi_agent:ProposerSolver", "max_turns": 2},
        "rewards": None,
        "rollout": {"prompts_per_step": 4, "group_size": 8},
        "train": {"learning_rate": 0.01, "micro_batch_tokens": 512},
        "sft": None,
        "checkpoint.every": 4,
    }
    return write_config(
        directory, artifacts, multi_agent, *overrides, steps=steps, filename="multi_agent.toml"
    )


def test_both_agents_learn_with_their_own_weights(tmp_path: Path, artifacts: Path) -> None:
    lines = train(multi_agent_config(tmp_path, artifacts, steps=14))
    for agent in AGENTS:
        rewards = [line[f"{agent}/reward_mean"] for line in lines]
        assert mean(rewards[-4:]) > mean(rewards[:4]) + 0.2, (agent, rewards)
        assert all(line[f"{agent}/turns"] == 32 for line in lines)
    assert [line["solver/learning_rate"] for line in lines[:1]] == [0.02]
    assert [line["proposer/learning_rate"] for line in lines[:1]] == [0.01]

    policies = tmp_path / "out" / "checkpoints" / "step-00000014" / "policy"
    weights = {agent: load_file(str(policies / agent / "model" / "model.safetensors")) for agent in AGENTS}
    assert weights["proposer"].keys() == weights["solver"].keys()
    moved = [
        name for name in weights["proposer"] if (weights["proposer"][name] != weights["solver"][name]).any()
    ]
    assert moved, "the two agents' checkpoints hold the same weights"

    assert {sample["agent"] for sample in samples(tmp_path)} == set(AGENTS)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["agents"] == list(AGENTS) and summary["steps_completed"] == 14


def test_a_resumed_multi_agent_run_is_identical(tmp_path: Path, artifacts: Path) -> None:
    config = multi_agent_config(tmp_path, artifacts, steps=6)
    uninterrupted = train(config)
    train(config, "--overwrite", "--set", "run.steps=4")
    resumed = train(config, "--resume")
    keys = [f"{agent}/{name}" for agent in AGENTS for name in ("reward_mean", "loss", "grad_norm")]
    assert [[line[k] for k in keys] for line in resumed] == [
        [line[k] for k in keys] for line in uninterrupted
    ]


def test_check_lists_the_agents_and_refuses_mismatches(tmp_path: Path, artifacts: Path) -> None:
    config = multi_agent_config(tmp_path, artifacts, steps=2)
    agents_line = config.read_text().splitlines().index("[agents.proposer]") + 1

    checked = rollout("check", config, check=False)
    assert checked.returncode == 0, checked.stderr[-3000:]
    agents = [line.split()[1] for line in checked.stdout.splitlines() if line.strip().startswith("agent ")]
    assert agents == ["proposer", "solver"], checked.stdout
    assert "(learning rate 0.02)" in checked.stdout and "ProposerSolver" in checked.stdout

    renamed = rollout("check", config, "--set", "agents.teacher={}", check=False)
    assert renamed.returncode == 2, renamed.stderr
    assert "configure exactly its agents" in renamed.stderr and "teacher" in renamed.stderr

    launched = rollout("launch", config, check=False)
    assert launched.returncode == 2, launched.stderr
    assert f"multi_agent.toml:{agents_line}:" in launched.stderr
    assert "with `rollout run`" in launched.stderr

    format_reward = {"rewards": [{"plugin": "python_plugins.rewards:Format"}]}
    rewarded = multi_agent_config(tmp_path, artifacts, format_reward, steps=2)
    refused = rollout("run", rewarded, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "come from its environment" in refused.stderr
