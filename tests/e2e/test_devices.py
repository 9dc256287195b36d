"""End to end: `rollout launch` gives each role process the devices `[cluster.devices]`
assigns it (CUDA_VISIBLE_DEVICES and LOCAL_RANK), and drives colocated workers through
releasing and restoring their memory around every update. On a machine without GPUs the
launcher is shown a made-up CUDA_VISIBLE_DEVICES; the roles then run on the CPU as usual."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tests.e2e.harness import cluster, launch, learning_signal, metrics, write_config


def _env(**values: str) -> dict[str, str]:
    return {**os.environ, **values}


def test_each_role_process_gets_its_devices(tmp_path: Path, artifacts: Path) -> None:
    devices = {"devices": {"trainers": [0, 1], "workers": [2, 3]}}
    config = write_config(tmp_path, artifacts, cluster(2, 2, 0, **devices), steps=2)
    result = launch(config, env=_env(CUDA_VISIBLE_DEVICES="GPU-a,GPU-b,GPU-c,GPU-d"))
    # Each role logs what it was given as it connects.
    pattern = (
        r"`([\w-]+)` connected to the controller [^\n]*; CUDA_VISIBLE_DEVICES=([^,\s]+), LOCAL_RANK=(\d)"
    )
    seen = {name: (devices, int(rank)) for name, devices, rank in re.findall(pattern, result.stderr)}
    assert seen == {
        "trainer-0": ("GPU-a", 0),
        "trainer-1": ("GPU-b", 1),
        "worker-0": ("GPU-c", 0),
        "worker-1": ("GPU-d", 1),
    }, result.stderr[-4000:]
    assert "worker-1 gets CUDA devices GPU-d" in result.stderr
    assert [line["step"] for line in metrics(tmp_path)] == [1, 2]


def test_a_device_that_is_not_visible_is_a_located_config_error(tmp_path: Path, artifacts: Path) -> None:
    devices = {"devices": {"trainers": [0], "workers": [5]}}
    config = write_config(tmp_path, artifacts, cluster(1, 1, 0, **devices), steps=1)
    result = launch(config, check=False, env=_env(CUDA_VISIBLE_DEVICES="0,1"))
    assert result.returncode != 0
    assert re.search(
        r"e2e\.toml:\d+:\d+: `cluster\.devices\.workers\[0\]`: device 5 is not visible: 2 GPUs are visible",
        result.stderr,
    ), result.stderr[-3000:]
    assert "started worker-0" not in result.stderr


def test_colocated_workers_release_and_restore_around_every_update(tmp_path: Path, artifacts: Path) -> None:
    separate_dir, colocated_dir = tmp_path / "separate", tmp_path / "colocated"
    separate_dir.mkdir()
    colocated_dir.mkdir()
    launch(write_config(separate_dir, artifacts, cluster(1, 1, 0), steps=3))
    colocated = cluster(1, 1, 0, devices={"colocate": True})
    result = launch(
        write_config(colocated_dir, artifacts, colocated, steps=3),
        env=_env(CUDA_VISIBLE_DEVICES="0", ROLLOUT_LOG="info,rollout::processes::worker=debug"),
    )
    # Both roles on the one device; the worker released and restored once per RL update
    # (a no-op for a policy on the CPU, but the whole path runs).
    assert result.stderr.count("CUDA_VISIBLE_DEVICES=0, LOCAL_RANK=0") == 2, result.stderr[-4000:]
    assert result.stderr.count("Release of the generation memory took") == 3
    assert result.stderr.count("Restore of the generation memory took") == 3
    # And nothing else changes: the same samples, rewards and losses.
    assert learning_signal(metrics(colocated_dir)) == learning_signal(metrics(separate_dir))
