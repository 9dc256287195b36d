"""A disk that fills up during a checkpoint: a clear error, the previous checkpoint intact,
and `--resume` (once there is room) continues the run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import assert_valid_checkpoint, metrics, run, write_config

# One checkpoint of the test model (weights and optimizer state) is about 480 KiB: the disk
# holds the warm start's checkpoint and not the next one.
SMALL_DISK = "900k"


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(small_disk: Path, artifacts: Path) -> None:
    config = write_config(small_disk, artifacts, steps=6)
    failed = run(config, check=False)
    assert failed.returncode != 0
    assert "No space left on device" in failed.stderr, failed.stderr[-3000:]
    assert "panicked" not in failed.stderr
    checkpoints = small_disk / "out" / "checkpoints"
    latest = (checkpoints / "latest").read_text().strip()
    assert latest == "step-00000000"
    assert_valid_checkpoint(checkpoints / latest, min_step=0, max_step=0)
    written = [line["step"] for line in metrics(small_disk)]
    assert written and written == list(range(1, len(written) + 1))

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    resumed = run(config, "--resume", check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [line["step"] for line in metrics(small_disk)] == [1, 2, 3, 4, 5, 6]
    assert not list(checkpoints.glob("*.partial")), "a half-written checkpoint was left behind"
