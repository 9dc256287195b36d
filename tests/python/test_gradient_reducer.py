"""Gradient all-reduce across two gloo ranks, uncompressed and through torch's DDP hooks."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.gradient_reducer_rank import local_gradients

WORKER = Path(__file__).parents[1] / "fixtures" / "gradient_reducer_rank.py"
UPDATES = 4
FULL_BYTES = (16 * 24 + 16) * 4


def reduce_on_two_ranks(compression: str) -> list[list[dict]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        command = [sys.executable, str(WORKER), compression, str(UPDATES)]
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    outputs = []
    for process in ranks:
        stdout, _ = process.communicate(timeout=120)
        assert process.returncode == 0
        outputs.append(json.loads(stdout))
    return outputs


def exact_sum(update: int) -> tuple[torch.Tensor, torch.Tensor]:
    (w0, b0), (w1, b1) = local_gradients(0, update), local_gradients(1, update)
    return w0 + w1, b0 + b1


@pytest.mark.parametrize(
    ("compression", "tolerance", "bytes_per_update"),
    [("none", 0.0, FULL_BYTES), ("fp16", 5e-3, FULL_BYTES // 2), ("bf16", 4e-2, FULL_BYTES // 2)],
)
def test_dense_all_reduce_sums_the_ranks_gradients(
    compression: str, tolerance: float, bytes_per_update: int
) -> None:
    outputs = reduce_on_two_ranks(compression)
    assert outputs[0] == outputs[1]
    for update, result in enumerate(outputs[0]):
        weight, bias = exact_sum(update)
        torch.testing.assert_close(torch.tensor(result["weight"]), weight, atol=tolerance * 4, rtol=tolerance)
        torch.testing.assert_close(torch.tensor(result["bias"]), bias, atol=tolerance * 4, rtol=tolerance)
        assert result["bytes"] == bytes_per_update


def test_powersgd_sends_low_rank_factors_after_its_warmup() -> None:
    outputs = reduce_on_two_ranks("powersgd")
    assert outputs[0] == outputs[1]
    for update, result in enumerate(outputs[0]):
        weight, bias = exact_sum(update)
        # A sum of two rank-1 matrices is rank 2: rank-2 PowerSGD reconstructs it.
        torch.testing.assert_close(torch.tensor(result["weight"]), weight, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(result["bias"]), bias, atol=1e-5, rtol=1e-5)
        warming_up = update < 2
        low_rank = (16 + 24) * 2 + 16
        assert result["bytes"] == (FULL_BYTES if warming_up else low_rank * 4)
