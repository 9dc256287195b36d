"""Every algorithm learns, through the binary, on the tiny local model from the same start.

The policy-gradient algorithms raise a reward any tiny model can learn quickly (the share of
7s in a completion); DPO raises its preference accuracy and lowers its loss on addition pairs
(the right answer against one digit changed); SFT lowers its loss. Each run is a few seconds.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_rollout_binary import ROLLOUT, artifacts  # noqa: F401  (a fixture)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def write_config(directory: Path, artifacts: Path, algorithm: str, steps: int) -> Path:  # noqa: F811
    samples = algorithm not in ("dpo", "sft")
    reward = '[[rewards]]\nplugin = "algorithm_plugins:CharacterShare"' if samples else ""
    pairs = (
        '[[data.transforms]]\nplugin = "python_plugins.data:WrongAnswerPairs"' if algorithm == "dpo" else ""
    )
    options = {
        "reinforce_pp": "kl_coef = 0.01",
        "dpo": "beta = 0.5",
        "gspo": "overlong_buffer = 1\noverlong_penalty = 0.1",
    }.get(algorithm, "")
    text = f"""
[run]
name = "{algorithm}"
output_dir = "{directory / "out"}"
seed = 3
steps = {steps}

[python]
paths = ["{FIXTURES}"]

[policy]
plugin = "python_plugins.hf_policy:HFCausalLM"
options = {{ model_path = "{artifacts / "model"}", torch_threads = 1 }}

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{artifacts / "data" / "train.jsonl"}", template = "{{question}}" }}
{pairs}

{reward}

[algorithm]
name = "{algorithm}"
{options}

[rollout]
prompts_per_step = {4 if samples else 16}
group_size = 8
max_new_tokens = 4

[train]
learning_rate = {0.01 if samples else 0.003}
micro_batch_tokens = 512

[checkpoint]
every = 4
"""
    path = directory / f"{algorithm}.toml"
    path.write_text(text)
    return path


def run(config: Path, *args: str) -> list[dict]:
    finished = subprocess.run(
        [str(ROLLOUT), "run", str(config), *args], capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = (config.parent / "out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo"])
def test_policy_gradient_algorithms_raise_the_reward(tmp_path: Path, artifacts: Path, algorithm: str) -> None:  # noqa: F811
    lines = run(write_config(tmp_path, artifacts, algorithm, steps=14))
    rewards = [line["reward_mean"] for line in lines]
    assert mean(rewards[-4:]) > mean(rewards[:4]) + 0.3, rewards
    if algorithm == "reinforce_pp":
        assert all(line["kl"] >= 0.0 for line in lines) and any(line["kl"] > 0.0 for line in lines)


def test_dpo_learns_to_prefer_the_right_answers(tmp_path: Path, artifacts: Path) -> None:  # noqa: F811
    lines = run(write_config(tmp_path, artifacts, "dpo", steps=16))
    losses = [line["loss"] for line in lines]
    accuracy = [line["reward_accuracy"] for line in lines]
    assert losses[0] == pytest.approx(0.6931, abs=1e-3), "the policy starts as its reference"
    assert mean(losses[-4:]) < losses[0] - 0.15, losses
    assert mean(accuracy[-4:]) > 0.75, accuracy
    assert all(line["micro_batches"] >= 1 and "reward_margin" in line for line in lines)


def test_sft_lowers_the_loss_and_resumes_exactly(tmp_path: Path, artifacts: Path) -> None:  # noqa: F811
    config = write_config(tmp_path, artifacts, "sft", steps=8)
    uninterrupted = run(config)
    assert uninterrupted[-1]["loss"] < 0.8 * uninterrupted[0]["loss"]
    run(config, "--overwrite", "--set", "run.steps=4")
    resumed = run(config, "--resume")
    assert [line["step"] for line in resumed] == list(range(1, 9))
    assert [line["loss"] for line in resumed] == [line["loss"] for line in uninterrupted]
