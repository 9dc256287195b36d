"""End to end: the built-in W&B (offline) and TensorBoard trackers as `[[callbacks]]` of
`rollout run` and `rollout launch`, read back with wandb's and TensorBoard's own readers."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import ROLLOUT, cluster, metrics, run, samples, write_config
from tests.python.tracking_readers import (
    scalars,
    tensorboard,
    texts,
    wandb_config,
    wandb_history,
    wandb_records,
    wandb_run_dirs,
    wandb_table,
)

TRACKERS = {
    "callbacks": [
        {
            "plugin": "python_plugins.tracking:WandbTracker",
            "options": {"project": "e2e", "tags": ["binary"], "log_samples_every": 2},
        },
        {"plugin": "python_plugins.tracking:TensorBoardTracker", "options": {"log_samples_every": 2}},
    ]
}
COLUMNS = ("step", "prompt", "completion", "reward", "advantage")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """The environment of the run: W&B offline and silent, nothing written outside tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return dict(os.environ)


def tracker_config(directory: Path, artifacts: Path, steps: int, *overrides: dict) -> Path:
    return write_config(directory, artifacts, TRACKERS, *overrides, {"run.log_samples": 4}, steps=steps)


def samples_of(out: Path, step: int) -> list[list]:
    return [[s[c] for c in COLUMNS] for s in samples(out.parent) if s["step"] == step]


def event_file_pids(log_dir: Path) -> set[int]:
    # events.out.tfevents.<time>.<host>.<pid>.<n>
    return {int(path.name.split(".")[-2]) for path in log_dir.glob("events.out.tfevents.*")}


def check_trackers(out: Path, steps: int, stderr: str) -> None:
    """Both trackers hold each step's metrics, the run's config and the sample tables."""
    assert "switched off" not in stderr, stderr[-4000:]
    lines = metrics(out.parent)
    assert [line["step"] for line in lines] == list(range(1, steps + 1))

    (run_dir,) = wandb_run_dirs(out)
    records = wandb_records(run_dir)
    history = wandb_history(records)
    assert sorted(history) == list(range(1, steps + 1))
    for line in lines:
        item = history[line["step"]]
        for name in ("reward_mean", "loss", "generated_tokens", "weight_version"):
            assert item[name] == pytest.approx(line[name], rel=1e-12), name
    config = wandb_config(records)
    assert config["run"]["name"] == "e2e" and config["run"]["steps"] == steps
    assert [c["plugin"] for c in config["callbacks"]] == [
        "python_plugins.tracking:WandbTracker",
        "python_plugins.tracking:TensorBoardTracker",
    ]
    tables = [step for step, item in history.items() if "samples.path" in item]
    assert tables == [step for step in range(1, steps + 1) if step % 2 == 0 or step == steps]
    for step in tables:
        table = wandb_table(run_dir, history[step])
        assert table["columns"] == list(COLUMNS)
        assert table["data"] == samples_of(out, step)
        assert len(table["data"]) == 4

    events = tensorboard(out / "tensorboard")
    rewards = scalars(events, "reward_mean")
    assert rewards == pytest.approx({line["step"]: line["reward_mean"] for line in lines}, rel=1e-6)
    assert list(texts(events, "samples")) == tables
    assert json.loads(texts(events, "config")[0].replace("\n    ", "\n"))["run"]["name"] == "e2e"


def test_rollout_run_with_wandb_offline_and_tensorboard(tmp_path: Path, artifacts: Path, offline) -> None:
    result = run(tracker_config(tmp_path, artifacts, steps=3))
    assert "done: 3 steps" in result.stdout
    out = tmp_path / "out"
    check_trackers(out, 3, result.stderr)
    # The W&B run id is kept for `--resume`.
    assert (out / "wandb_run_id").read_text().strip() in wandb_run_dirs(out)[0].name


def test_rollout_launch_tracks_once_from_the_controller(tmp_path: Path, artifacts: Path, offline) -> None:
    config = tracker_config(tmp_path, artifacts, 2, cluster(1, 1, 0))
    controller = subprocess.Popen(
        [str(ROLLOUT), "launch", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=offline,
    )
    try:
        _, stderr = controller.communicate(timeout=300)
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.communicate()
    assert controller.returncode == 0, stderr[-6000:]
    roles = {int(pid) for pid in re.findall(r"started \S+ \(pid (\d+)\)", stderr)}
    assert len(roles) == 2, stderr[-3000:]

    out = tmp_path / "out"
    check_trackers(out, 2, stderr)
    # One W&B run and one event file, both written by the controller (`rollout launch` itself),
    # none by the generation worker or the trainer rank.
    assert event_file_pids(out / "tensorboard") == {controller.pid}
    assert len(wandb_run_dirs(out)) == 1
