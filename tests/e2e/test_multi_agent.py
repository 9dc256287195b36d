"""Multi-agent runs through the binary: a proposer and a solver, each its own copy of the tiny
model with its own optimizer and checkpoint, learn together in ProposerSolver."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from safetensors.numpy import load_file

from tests.e2e.test_rollout_binary import ROLLOUT, artifacts  # noqa: F401  (a fixture)

AGENTS = ("proposer", "solver")


def write_config(directory: Path, artifacts: Path, *, steps: int, extra: str = "") -> Path:  # noqa: F811
    text = f"""[run]
name = "multi-agent"
output_dir = "{directory / "out"}"
seed = 3
steps = {steps}
log_samples = 4

[policy]
plugin = "python_plugins.hf_policy:HFCausalLM"
options = {{ model_path = "{artifacts / "model"}", torch_threads = 1 }}

[agents.proposer]

[agents.solver]
learning_rate = 0.02

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{artifacts / "data" / "train.jsonl"}", template = "{{question}}" }}

[environment]
plugin = "python_plugins.multi_agent:ProposerSolver"
max_turns = 2

[rollout]
prompts_per_step = 4
group_size = 8
max_new_tokens = 4

[train]
learning_rate = 0.01
micro_batch_tokens = 512

[checkpoint]
every = 4
{extra}"""
    path = directory / "multi_agent.toml"
    path.write_text(text)
    return path


def rollout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROLLOUT), *args], capture_output=True, text=True, timeout=300)


def run(config: Path, *args: str) -> list[dict]:
    finished = rollout("run", str(config), *args)
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = (config.parent / "out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_both_agents_learn_with_their_own_weights(tmp_path: Path, artifacts: Path) -> None:  # noqa: F811
    lines = run(write_config(tmp_path, artifacts, steps=14))
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

    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert {sample["agent"] for sample in samples} == set(AGENTS)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["agents"] == list(AGENTS) and summary["steps_completed"] == 14


def test_a_resumed_multi_agent_run_is_identical(tmp_path: Path, artifacts: Path) -> None:  # noqa: F811
    config = write_config(tmp_path, artifacts, steps=6)
    uninterrupted = run(config)
    run(config, "--overwrite", "--set", "run.steps=4")
    resumed = run(config, "--resume")
    keys = [f"{agent}/{name}" for agent in AGENTS for name in ("reward_mean", "loss", "grad_norm")]
    assert [[line[k] for k in keys] for line in resumed] == [
        [line[k] for k in keys] for line in uninterrupted
    ]


def test_check_lists_the_agents_and_refuses_mismatches(tmp_path: Path, artifacts: Path) -> None:  # noqa: F811
    config = write_config(tmp_path, artifacts, steps=2)
    agents_line = config.read_text().splitlines().index("[agents.proposer]") + 1

    checked = rollout("check", str(config))
    assert checked.returncode == 0, checked.stderr[-3000:]
    agents = [line.split()[1] for line in checked.stdout.splitlines() if line.strip().startswith("agent ")]
    assert agents == ["proposer", "solver"], checked.stdout
    assert "(learning rate 0.02)" in checked.stdout and "ProposerSolver" in checked.stdout

    renamed = rollout("check", str(config), "--set", "agents.teacher={}")
    assert renamed.returncode == 2, renamed.stderr
    assert "configure exactly its agents" in renamed.stderr and "teacher" in renamed.stderr

    launched = rollout("launch", str(config))
    assert launched.returncode == 2, launched.stderr
    assert f"multi_agent.toml:{agents_line}:" in launched.stderr
    assert "with `rollout run`" in launched.stderr

    rewarded = write_config(
        tmp_path, artifacts, steps=2, extra='[[rewards]]\nplugin = "python_plugins.rewards:Format"\n'
    )
    refused = rollout("run", str(rewarded))
    assert refused.returncode == 2, refused.stderr
    assert "come from its environment" in refused.stderr
