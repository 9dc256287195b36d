"""End to end: RLHF with a learned reward model as the only reward.

The demo reward model (python -m python_plugins.reward_models create-demo) prefers completions
that contain the digit 7; an untrained tiny Llama with the same character tokenizer learns,
through `rollout run` and nothing but the reward model's scores, to write 7s. Then the same
run with the reward model in a sandbox process scores the same.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from python_plugins.quickstart import create_tiny_model, write_addition_splits
from python_plugins.reward_models import create_demo_reward_model, has_demo_property

REPO = Path(__file__).resolve().parents[2]
ROLLOUT = Path(os.environ.get("ROLLOUT_BIN", REPO / "target" / "release" / "rollout"))
STEPS = 20
WINDOW = 5  # steps averaged at the start and at the end
METRIC = "reward/reward_model"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not ROLLOUT.exists():
        pytest.fail(f"{ROLLOUT} is missing: run scripts/setup.sh (or set ROLLOUT_BIN)")
    root = tmp_path_factory.mktemp("rlhf")
    create_tiny_model(root / "policy", hidden_size=32, num_layers=2, num_heads=2, max_positions=512, seed=0)
    write_addition_splits(root / "data", train=64, test=16, seed=0, digits=1)
    create_demo_reward_model(root / "reward_model", seed=0)
    return root


def write_config(directory: Path, artifacts: Path, *, steps: int, extra: str = "") -> Path:
    reward_model = f'model_path = "{artifacts / "reward_model"}", normalize = "sigmoid"'
    text = f"""
[run]
output_dir = "{directory / "out"}"
seed = 1
steps = {steps}
log_samples = 1000

[policy]
plugin = "python_plugins.hf_policy:HFCausalLM"
options = {{ model_path = "{artifacts / "policy"}", torch_threads = 1 }}

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{artifacts / "data" / "train.jsonl"}", template = "{{question}}" }}

[[rewards]]
plugin = "python_plugins.reward_models:SequenceClassifierReward"
name = "reward_model"
options = {{ {reward_model}, batch_size = 32, torch_threads = 1 }}

[rollout]
prompts_per_step = 4
group_size = 8
max_new_tokens = 4

[train]
learning_rate = 0.01
{extra}
"""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "rlhf.toml"
    path.write_text(text)
    return path


def run(config: Path) -> None:
    result = subprocess.run(
        [str(ROLLOUT), "run", str(config)], capture_output=True, text=True, cwd=config.parent, timeout=300
    )
    if result.returncode != 0:
        pytest.fail(f"rollout exited {result.returncode}\n{result.stderr}")


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def in_process(artifacts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("in_process")
    run(write_config(directory, artifacts, steps=STEPS))
    return directory / "out"


def test_the_reward_model_alone_teaches_the_policy_what_it_prefers(in_process: Path) -> None:
    metrics = read_lines(in_process / "metrics.jsonl")
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    scores = [line[METRIC] for line in metrics]
    first, last = mean(scores[:WINDOW]), mean(scores[-WINDOW:])
    print(f"mean reward-model score: first {WINDOW} steps {first:.3f}, last {WINDOW} steps {last:.3f}")
    assert last - first > 0.4 and last > 0.7, scores
    # The preference is real, not a blind spot of the reward model: the completions do have 7s.
    samples = read_lines(in_process / "samples.jsonl")
    share = [
        mean([float(has_demo_property(s["completion"])) for s in samples if s["step"] == step])
        for step in range(1, STEPS + 1)
    ]
    first, last = mean(share[:WINDOW]), mean(share[-WINDOW:])
    print(f"completions with a 7: first {WINDOW} steps {first:.3f}, last {WINDOW} steps {last:.3f}")
    assert last - first > 0.4, share


def test_the_reward_model_scores_the_same_in_a_sandbox_process(
    artifacts: Path, in_process: Path, tmp_path: Path
) -> None:
    sandboxed = write_config(tmp_path, artifacts, steps=2, extra="\n[sandbox]\nprocesses = 1\n")
    run(sandboxed)
    metrics = read_lines(tmp_path / "out" / "metrics.jsonl")
    assert [line["step"] for line in metrics] == [1, 2]
    assert all(line["reward_failed"] == 0 and line["completions"] == 32 for line in metrics)
    # Step 1 samples the same completions as the in-process run; one sample per call in the
    # sandbox scores them as the batches of 32 did in the embedded interpreter.
    reference = read_lines(in_process / "metrics.jsonl")[0]
    assert metrics[0][METRIC] == pytest.approx(reference[METRIC], abs=1e-5)
    samples = read_lines(tmp_path / "out" / "samples.jsonl")
    assert all(s["failed"] is None for s in samples)
