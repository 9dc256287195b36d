"""Devices per process on a CUDA machine (skipped without one): a process given one GPU in
CUDA_VISIBLE_DEVICES sees exactly that GPU as cuda:0, and trainer ranks placed that way
all-reduce over NCCL through ``rollout_sdk.distributed``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]

SEES = """
import torch
print(torch.cuda.device_count(), torch.cuda.get_device_properties(0).uuid)
"""

RANK = """
import os, torch, torch.distributed as dist
from rollout_sdk.distributed import init_process_group, leave_process_group
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
parameter = torch.nn.Parameter(torch.zeros(4, device="cuda"))
init_process_group("auto", rank, world, [parameter], timeout_seconds=120)
value = torch.full((4,), float(rank + 1), device="cuda")
dist.all_reduce(value)
print(dist.get_backend(), torch.cuda.current_device(), torch.cuda.device_count(), value.tolist())
leave_process_group()
"""


def _python(code: str, **env: str) -> subprocess.Popen[str]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    pipe = subprocess.PIPE
    return subprocess.Popen(
        [sys.executable, "-c", code], env=environment, stdout=pipe, stderr=pipe, text=True
    )


def _output(process: subprocess.Popen[str]) -> str:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return out.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_process_sees_the_gpu_it_was_given_as_cuda_0():
    for index in range(torch.cuda.device_count()):
        expected = str(torch.cuda.get_device_properties(index).uuid)
        count, uuid = _output(_python(SEES, CUDA_VISIBLE_DEVICES=str(index))).split()
        assert (count, uuid) == ("1", expected)


@pytest.mark.parametrize("world", [1, 2])
def test_trainer_ranks_on_one_gpu_each_all_reduce_over_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    port = str(_free_port())
    ranks = [
        _python(
            RANK,
            CUDA_VISIBLE_DEVICES=str(rank),
            LOCAL_RANK=str(rank),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for rank in range(world)
    ]
    total = float(sum(range(1, world + 1)))
    for process in ranks:
        # NCCL, on cuda:0 of the rank's own CUDA_VISIBLE_DEVICES whatever its LOCAL_RANK.
        assert _output(process) == f"nccl 0 1 {[total] * 4}"
