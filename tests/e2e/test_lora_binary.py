"""End to end: a LoRA policy through the `rollout` binary, in one process and as a launched cluster."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.e2e.harness import POOL_METRICS, cluster, launch, learning_signal, metrics, run, write_config

# The e2e model: 2 layers, hidden size 32; rank 4 on q/k/v/o: 2 * 4 * (4 * 32 + 32 * 4) floats.
ADAPTER_BYTES = 2 * 4 * (4 * 32 + 32 * 4) * 4
STEPS = 4
# The worker logs every weight version it swaps in, with its size, at debug level.
WORKER_DEBUG = "info,rollout::processes::worker=debug"


def lora_config(directory: Path, artifacts: Path, *, steps: int) -> Path:
    # KL to the reference (the base with the adapters disabled) and the [cluster] section,
    # which `rollout run` ignores, so the local and the launched runs share one config.
    lora = {"policy.options": {"lora_rank": 4, "lora_alpha": 8.0}, "algorithm.kl_coef": 0.05}
    return write_config(directory, artifacts, lora, cluster(1, 1, 0), steps=steps)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, artifacts: Path) -> Path:
    """A LoRA run of STEPS steps in one process (checkpoints every 2 steps)."""
    directory = tmp_path_factory.mktemp("lora_straight")
    result = run(lora_config(directory, artifacts, steps=STEPS))
    assert f"a weight sync sends {ADAPTER_BYTES:,} bytes" in result.stderr
    return directory


def test_lora_run_trains_only_the_adapters_and_resumes_exactly(
    straight: Path, tmp_path: Path, artifacts: Path
) -> None:
    lines = metrics(straight)
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert all(line["kl"] > 0 for line in lines), "two SFT updates moved the adapters off the reference"
    model_dir = straight / "out" / "checkpoints" / f"step-{STEPS:08d}" / "policy" / "model"
    files = sorted(path.name for path in model_dir.iterdir())
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files
    assert "model.safetensors" not in files, "the frozen base is not copied into checkpoints"
    adapters = load_file(model_dir / "adapter_model.safetensors")
    assert sum(t.numel() * 4 for t in adapters.values()) == ADAPTER_BYTES
    assert all(".lora_A." in name or ".lora_B." in name for name in adapters)
    # lora_B starts at zero: every one of them trained.
    assert all(t.abs().max() > 0 for name, t in adapters.items() if ".lora_B." in name)
    base_config = json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base_config) == (artifacts / "model").resolve()
    # The checkpoint loads with transformers (base + adapters) and differs from the base.
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        tuned = AutoModelForCausalLM.from_pretrained(model_dir).eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(artifacts / "model").eval()(ids).logits
    assert not torch.allclose(tuned, base)

    config = lora_config(tmp_path, artifacts, steps=2)
    run(config)
    resumed = run(config, "--resume", "--set", f"run.steps={STEPS}")
    assert "resumed from" in resumed.stderr
    assert learning_signal(metrics(tmp_path)) == learning_signal(lines)


def test_launched_lora_run_syncs_only_adapter_bytes_and_matches_rollout_run(
    straight: Path, tmp_path: Path, artifacts: Path
) -> None:
    config = lora_config(tmp_path, artifacts, steps=STEPS)
    result = launch(config, env={**os.environ, "ROLLOUT_LOG": WORKER_DEBUG})
    served = {
        int(version): int(size)
        for version, size in re.findall(r"serving weight version (\d+) \((\d+) bytes", result.stderr)
    }
    # The weights after the SFT warm start (version 2), then after every RL update, reached
    # the worker, each as the adapters' bytes only.
    assert sorted(served) == list(range(2, 3 + STEPS)), result.stderr[-3000:]
    full_bytes = (artifacts / "model" / "model.safetensors").stat().st_size
    assert all(size == ADAPTER_BYTES for size in served.values()), (served, ADAPTER_BYTES)
    assert ADAPTER_BYTES < full_bytes / 10
    # The controller checked the worker's checksum of every version against the trainer's; the
    # worker generated with exactly the trainer's weights: the same samples, rewards, losses.
    remote = [{k: v for k, v in line.items() if k not in POOL_METRICS} for line in metrics(tmp_path)]
    remote = [{k: v for k, v in line.items() if not k.startswith("worker_")} for line in remote]
    assert learning_signal(remote) == learning_signal(metrics(straight))
