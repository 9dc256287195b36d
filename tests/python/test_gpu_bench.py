"""``bench/gpu``'s cheapest stage, its time guard and its refusal without CUDA, on the CPU.

The whole dry run (``bench/gpu --dry-run``, about a minute) starts the binary several times;
these run in-process in a few seconds: the weight-sync copies of a tiny model, the JSON the
script writes, a stage skipped by the time guard and a subprocess stopped by it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bench import gpu, gpu_guard


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench_gpu")


def test_dry_run_weight_sync_writes_the_figures(work: Path) -> None:
    out = work / "gpu.json"
    status = gpu.main(["--dry-run", "--stages", "weight_sync", "--work", str(work), "--out", str(out)])
    assert status == 0
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert report["device"] == "cpu"
    assert report["gpu"] is None
    assert report["host_cpu"]
    assert report["torch"] == torch.__version__
    assert report["model"]["parameters"] > 0
    assert 0 < report["wall_seconds"] < report["budget_seconds"]

    sync = report["stages"]["weight_sync"]
    assert sync["status"] == "ok"
    assert sync["bytes"] == 4 * report["model"]["parameters"]
    assert sync["pinned_available"] is False  # pinned memory needs CUDA
    for kind in ("pinned", "pageable"):
        for direction in ("device_to_host", "host_to_device"):
            assert sync[kind][f"{direction}_gb_per_second"] > 0
            assert len(sync[kind][f"{direction}_seconds"]) == gpu.DRY.sync_repeats
    assert set(sync["memory"]) == {"max_memory_allocated_bytes", "max_memory_reserved_bytes"}

    summary = report["summary"]
    assert summary["pinned_device_to_host_gb_per_second"] > 0
    assert summary["pageable_host_to_device_gb_per_second"] > 0
    assert summary["engine_tokens_per_second"] is None  # not run
    assert set(summary["peak_memory"]) == {"weight_sync", "hf_generate", "engine", "grpo", "launch"}


def test_time_guard_skips_a_stage_that_does_not_fit(work: Path) -> None:
    out = work / "skipped.json"
    args = ["--dry-run", "--stages", "weight_sync", "--budget-seconds", "0"]
    status = gpu.main([*args, "--work", str(work), "--out", str(out)])
    assert status == 0
    stage = json.loads(out.read_text())["stages"]["weight_sync"]
    assert stage["status"] == "skipped"
    assert "time guard" in stage["reason"]


def test_time_guard_stops_a_subprocess_and_its_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f"sleep 30 & echo $! > {pids}; sleep 30 & echo $! >> {pids}; wait"
    started = time.perf_counter()
    with pytest.raises(gpu_guard.StageTimeout), gpu_guard.deadline(1.0):
        gpu_guard.run_logged(["bash", "-c", script], tmp_path / "sleep.log")
    assert time.perf_counter() - started < 10
    children = [int(line) for line in pids.read_text().split()]
    assert len(children) == 2
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in children)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_without_cuda_the_full_run_refuses(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = work / "refused.json"
    assert gpu.main(["--work", str(work), "--out", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not out.exists()
