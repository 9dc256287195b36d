"""End to end: FSDP2-sharded trainer ranks under `rollout launch`, at the shipped distributed
settings (2 ranks, staleness 1), resumed on another rank count, and exported."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.e2e.harness import assert_valid_checkpoint, cluster, launch, metrics, rollout, write_config

SHARDED = {"train.sharding": "fsdp", "checkpoint.every": 2}


def test_sharded_ranks_train_checkpoint_resume_on_one_rank_and_export(
    tmp_path: Path, artifacts: Path
) -> None:
    config = write_config(tmp_path, artifacts, cluster(1, 2, 1), SHARDED, steps=4)
    first = launch(config)
    output = tmp_path / "out"
    lines = metrics(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert all(math.isfinite(line["loss"]) and line["grad_norm"] >= 0 for line in lines)
    # The workers serve whole weights gathered from the shards, version after version.
    assert lines[-1]["weight_version"] > lines[0]["weight_version"]
    peaks = [line for line in (first.stdout + first.stderr).splitlines() if "peak resident memory" in line]
    assert len(peaks) == 2, peaks
    checkpoint = output / "checkpoints" / "step-00000004"
    assert_valid_checkpoint(checkpoint, max_step=4, min_step=4)
    shards = sorted(p.name for p in (checkpoint / "policy" / "shards").iterdir())
    assert shards == [f"rank-0000{r}.{ext}" for r in (0, 1) for ext in ("json", "safetensors")]
    table = json.loads((checkpoint / "policy" / "shards" / "rank-00001.json").read_text())
    assert table["world_size"] == 2 and table["rank"] == 1

    # Resharded: the 2-rank checkpoint continues on one rank.
    launch(config, "--resume", "--set", "run.steps=6", "--set", "cluster.trainers=1")
    resumed = metrics(tmp_path)
    assert [line["step"] for line in resumed] == [1, 2, 3, 4, 5, 6]
    assert resumed[4]["weight_version"] == lines[-1]["weight_version"] + 1

    exported = tmp_path / "hf"
    rollout("export", output / "checkpoints" / "step-00000006", exported)
    model = AutoModelForCausalLM.from_pretrained(exported, use_safetensors=True)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
    again = rollout("export", output / "checkpoints" / "step-00000006", exported, check=False)
    assert again.returncode != 0 and "exists" in again.stderr
