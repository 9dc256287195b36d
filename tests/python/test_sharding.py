"""FSDP2-sharded trainer ranks: the same training as one process, checkpoints that reshard,
and a Hugging Face export of a sharded checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from python_plugins.checkpoint_export import export_checkpoint
from python_plugins.quickstart import create_tiny_model
from python_plugins.sharded_checkpoint import ShardedTensors, shard_files
from rollout_sdk.snapshot import write_snapshot

RANK = Path(__file__).parents[1] / "fixtures" / "sharded_rank.py"
CASES = "grpo,sft,dpo,ppo,lora"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("model")
    create_tiny_model(directory, seed=0)
    return directory


def run_ranks(model: Path, ranks: int, *args: str) -> dict[int, dict]:
    """Runs the fixture on ``ranks`` gloo ranks (0: one process, no group); reports by rank."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = []
    for rank in range(max(ranks, 1)):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONWARNINGS="ignore",
        )
        mode = [] if ranks else ["--mode", "single"]
        command = [sys.executable, str(RANK), str(model), *mode, *args]
        processes.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    reports = {}
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        report = json.loads(stdout.strip().splitlines()[-1])
        reports[report["rank"]] = report["cases"]
    return reports


def merged_losses(reports: dict[int, dict], case: str) -> dict[str, float]:
    return {index: loss for report in reports.values() for index, loss in report[case]["losses"].items()}


@pytest.fixture(scope="module")
def one_process(model_dir: Path) -> dict:
    return run_ranks(model_dir, 0, "--cases", CASES, "--updates", "4")[0]


@pytest.fixture(scope="module")
def two_ranks(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    return run_ranks(model_dir, 2, "--cases", CASES, "--save", str(checkpoints)), checkpoints


@pytest.mark.parametrize("case", CASES.split(","))
def test_two_sharded_ranks_train_as_one_process(case: str, one_process: dict, two_ranks: tuple) -> None:
    reports, _ = two_ranks
    expected = one_process[case]
    losses = merged_losses(reports, case)
    assert sorted(losses) == [f"{update}.{index}" for update in range(2) for index in range(4)]
    for index, loss in losses.items():
        assert loss == pytest.approx(expected["losses"][index], rel=1e-4, abs=1e-5), index
    assert reports[0][case]["norms"] == pytest.approx(expected["norms"][:2], rel=1e-4)
    assert all(norm > 0 for norm in reports[0][case]["norms"])
    # Rank 0 gathers every trained weight; the others take part in the gathers and keep none.
    assert reports[0][case]["weight_names"] == expected["weight_names"]
    assert reports[1][case]["weight_names"] == []
    # Each rank reduce-scatters half of the gradient bytes it holds unsharded.
    assert reports[0][case]["reduced_bytes"][0] > 0


def test_a_two_rank_checkpoint_resumes_exactly_on_one_and_two_ranks_and_replicated(
    model_dir: Path, one_process: dict, two_ranks: tuple
) -> None:
    _, checkpoints = two_ranks
    # 0: one process without a group, the policy replicated.
    for ranks in (0, 1, 2):
        reports = run_ranks(model_dir, ranks, "--cases", "grpo,lora", "--load", str(checkpoints))
        for case in ("grpo", "lora"):
            # Updates 3 and 4 of the uninterrupted run.
            assert reports[0][case]["norms"] == pytest.approx(one_process[case]["norms"][2:], rel=1e-4), ranks
            assert reports[0][case]["weights_sum"] == pytest.approx(
                one_process[case]["weights_sum"], rel=1e-6
            )


def test_the_export_of_a_sharded_checkpoint_gives_the_trainers_logits(
    model_dir: Path, two_ranks: tuple, tmp_path: Path
) -> None:
    reports, checkpoints = two_ranks
    exported = export_checkpoint(checkpoints / "grpo", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(exported, use_safetensors=True)
    ids = torch.tensor([reports[0]["grpo"]["probe_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    logprobs = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    trainer = reports[0]["grpo"]["probe_logprobs"]
    np.testing.assert_allclose(logprobs.numpy(), trainer[1:], rtol=1e-4, atol=1e-5)
    # The LoRA run exports an adapter directory, loaded on top of its base.
    adapter = export_checkpoint(checkpoints / "lora", tmp_path / "adapter")
    assert (adapter / "adapter_model.safetensors").is_file()
    assert (adapter / "adapter_config.json").is_file()


def test_bfloat16_compute_and_cpu_offload_train_close_to_float32(model_dir: Path, one_process: dict) -> None:
    reports = run_ranks(model_dir, 2, "--cases", "grpo", "--param-dtype", "bfloat16", "--offload")
    losses = merged_losses(reports, "grpo")
    for index, loss in losses.items():
        assert loss == pytest.approx(one_process["grpo"]["losses"][index], rel=0.05, abs=0.02)


def test_rows_are_assembled_from_uneven_shards_of_any_rank_count(tmp_path: Path) -> None:
    whole = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    # torch.chunk over 3 ranks: 3, 3 and 1 rows.
    for rank, (start, stop) in enumerate([(0, 3), (3, 6), (6, 7)]):
        pieces = [
            ("model/w", whole[start:stop], (7, 3), (start, stop)),
            ("optimizer/w/step", torch.tensor(5.0), (), (0, 1)),
        ]
        write_snapshot(shard_files(pieces, rank, 3), tmp_path)
    shards = ShardedTensors(tmp_path)
    assert shards.world_size == 3
    torch.testing.assert_close(shards.rows("model/w"), whole)
    torch.testing.assert_close(shards.rows("model/w", 2, 7), whole[2:7])
    torch.testing.assert_close(shards.rows("model/w", 4, 4), whole[4:4])
    assert float(shards.rows("optimizer/w/step")) == 5.0
    with pytest.raises(KeyError, match="no tensor `model/v`"):
        shards.rows("model/v")


def test_a_checkpoint_missing_a_rank_is_refused(tmp_path: Path) -> None:
    write_snapshot(shard_files([("model/w", torch.zeros(2, 2), (4, 2), (0, 2))], 0, 2), tmp_path)
    with pytest.raises(ValueError, match="incomplete"):
        ShardedTensors(tmp_path)


def test_export_refuses_an_existing_directory_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    policy = tmp_path / "checkpoint" / "policy"
    (policy / "model").mkdir(parents=True)
    (policy / "model" / "config.json").write_text("{}")
    save_file({"w": torch.zeros(1)}, str(policy / "model" / "model.safetensors"))
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        export_checkpoint(tmp_path / "checkpoint", tmp_path / "taken")
    (policy / "shards").mkdir()  # a sharded checkpoint without its tables
    with pytest.raises(FileNotFoundError, match="no shard tables"):
        export_checkpoint(tmp_path / "checkpoint", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "taken"]
