"""End to end: the `rollout` binary trains the real HF policy on a tiny local model."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.harness import ROLLOUT, cluster, learning_signal, metrics, run, samples, write_config

REQUIRED_METRICS = {
    "step",
    "reward_mean",
    "loss",
    "completions",
    "generated_tokens",
    "step_seconds",
    "samples_per_second",
    "weight_version",
}


def test_run_writes_metrics_checkpoint_and_summary(tmp_path: Path, artifacts: Path) -> None:
    result = run(write_config(tmp_path, artifacts))
    lines = metrics(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert REQUIRED_METRICS <= line.keys()
        assert line["completions"] == 8
        assert line["generated_tokens"] >= 8
    # Each line is stamped when written: consecutive stamps are at least that step long.
    elapsed = [line["elapsed_seconds"] for line in lines]
    for before, after, line in zip(elapsed[:-1], elapsed[1:], lines[1:], strict=True):
        assert after - before >= line["step_seconds"]
    # Two SFT updates precede the RL ones.
    assert [line["weight_version"] for line in lines] == [3, 4, 5]
    assert "reward_mean: first 10 steps" in result.stdout
    sft = (tmp_path / "out" / "sft_metrics.jsonl").read_text().splitlines()
    assert len(sft) == 2

    latest = (tmp_path / "out" / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-00000003"
    checkpoint = tmp_path / "out" / "checkpoints" / latest
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["step"] == 3 and state["weight_version"] == 5
    files = list(checkpoint.rglob("*"))
    assert not [f for f in files if f.suffix in {".pt", ".bin", ".pkl", ".pickle"}]


def test_checkpoint_loads_with_transformers(tmp_path: Path, artifacts: Path) -> None:
    run(write_config(tmp_path, artifacts))
    model_dir = tmp_path / "out" / "checkpoints" / "step-00000003" / "policy" / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    original = AutoModelForCausalLM.from_pretrained(artifacts / "model")
    saved = load_file(model_dir / "model.safetensors")
    assert set(saved) and all(torch.isfinite(t).all() for t in saved.values())
    ids = torch.tensor([[1, 2, 3, 4]])
    trained_logits = model(ids).logits
    assert not torch.allclose(trained_logits, original(ids).logits), "training changed nothing"


def test_same_seed_gives_identical_metrics(tmp_path: Path, artifacts: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    run(write_config(first, artifacts))
    run(write_config(second, artifacts))
    assert learning_signal(metrics(first)) == learning_signal(metrics(second))


def test_resume_continues_exactly(tmp_path: Path, artifacts: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir()
    split.mkdir()
    run(write_config(straight, artifacts, steps=4))
    config = write_config(split, artifacts, steps=2)
    run(config)
    resumed = run(config, "--resume", "--set", "run.steps=4")
    assert "resumed from" in resumed.stderr
    assert learning_signal(metrics(straight)) == learning_signal(metrics(split))


# Overlapped, Ctrl-C comes while the generation copy samples the next step on its own thread.
@pytest.mark.parametrize("staleness", [0, 1], ids=["synchronous", "overlapped"])
def test_ctrl_c_stops_cleanly_with_a_valid_checkpoint(
    tmp_path: Path, artifacts: Path, staleness: int
) -> None:
    config = write_config(tmp_path, artifacts, cluster(1, 1, staleness), steps=500)
    process = subprocess.Popen(
        [str(ROLLOUT), "run", str(config), "--set", "checkpoint.every=0"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics_file = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        metrics_file.exists() and metrics_file.read_text().count("\n") >= 2
    ):
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    latest = (tmp_path / "out" / "checkpoints" / "latest").read_text().strip()
    state = json.loads((tmp_path / "out" / "checkpoints" / latest / "state.json").read_text())
    assert state["step"] == len(metrics(tmp_path)) >= 2
    assert "interrupted" in stderr
    assert ("generation copy" in stderr) == (staleness > 0)
    resumed = run(config, "--resume", "--set", f"run.steps={state['step'] + 1}")
    assert resumed.returncode == 0
    assert metrics(tmp_path)[-1]["step"] == state["step"] + 1


def test_bad_plugin_option_is_reported_before_training(tmp_path: Path, artifacts: Path) -> None:
    misspelt = {"policy.options.torch_threads": None, "policy.options.torch_thread": 1}
    result = run(write_config(tmp_path, artifacts, misspelt), check=False)
    assert result.returncode == 2
    # Line 10 of the written file: [policy]'s options.
    assert "e2e.toml:10:" in result.stderr
    assert "did you mean `torch_threads`?" in result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_multi_turn_episodes_train_on_exactly_the_generated_tokens(tmp_path: Path, artifacts: Path) -> None:
    data = tmp_path / "secrets.jsonl"
    data.write_text("".join(json.dumps({"prompt": "guess", "secret": s}) + "\n" for s in (3, 7, 12)))
    guess_number = {
        "plugin": "python_plugins.environments:GuessNumber",
        "options": {"max_turns": 3},
        "max_turns": 3,
    }
    overrides = {
        "run": {"name": None, "seed": None, "log_samples": 8},
        "data.options": {"path": data, "template": None},
        "environment": guess_number,
        "rewards": None,
        "rollout.max_new_tokens": 3,
        "train.micro_batch_tokens": None,
        "sft": None,
        "checkpoint": None,
    }
    config = write_config(tmp_path, artifacts, overrides, steps=2, filename="multi.toml")
    run(config)
    lines = metrics(tmp_path)
    assert len(lines) == 2 and all("env_return_mean" in line for line in lines)
    # Later turns re-read the episode's context from the KV cache instead of prefilling it again.
    assert all(line["engine/prefix_cache_hit_tokens"] > 0 for line in lines)
    tokenizer = AutoTokenizer.from_pretrained(artifacts / "model")
    hints = {"\nhigher.\nguess: ", "\nlower.\nguess: ", "\nthat is not a number.\nguess: "}
    logged = samples(tmp_path)
    assert len(logged) == 16
    for sample in logged:
        tokens, generated = sample["tokens"], sample["generated"]
        assert len(tokens) == len(generated)
        assert sample["prompt"].startswith("i am thinking of a number")
        segments = []
        for token, flag in zip(tokens, generated, strict=True):
            if segments and segments[-1][0] == flag:
                segments[-1][1].append(token)
            else:
                segments.append((flag, [token]))
        assert not segments[0][0], "the episode starts with the environment's prompt"
        assert segments[-1][0], "the episode ends with the policy's last turn"
        turns = [ids for flag, ids in segments if flag]
        assert 1 <= len(turns) <= 3
        observations = [tokenizer.decode(ids) for flag, ids in segments[1:] if not flag]
        assert all(observation in hints for observation in observations), observations
