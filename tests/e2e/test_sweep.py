"""End to end: `rollout sweep` runs a 2-value grid of the tiny model, is interrupted after its
first run finished, and a rerun skips that run (its files untouched), completes the other and
writes the summary table and the overlaid report."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.harness import ROLLOUT, cluster, write_config

GRID = "train.learning_rate=0.001,0.002"
NAMES = ("learning_rate=0.001", "learning_rate=0.002")


def sweep_command(config: Path, output: Path, grid: str = GRID) -> list[str]:
    return [
        str(ROLLOUT),
        "sweep",
        str(config),
        "--grid",
        grid,
        "--set",
        "run.steps=2",
        "--output",
        str(output),
    ]


def sweep(config: Path, output: Path, grid: str = GRID) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        sweep_command(config, output, grid), capture_output=True, text=True, cwd=config.parent, timeout=300
    )


def wait_for(path: Path, process: subprocess.Popen[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            pytest.fail(f"the sweep exited {process.returncode} early\n{process.communicate()[1]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"{path} did not appear in {timeout}s")
        time.sleep(0.1)


def table_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def test_an_interrupted_sweep_continues_without_rerunning_finished_runs(
    tmp_path: Path,
    artifacts: Path,
) -> None:
    config = write_config(tmp_path, artifacts, steps=5)
    output = tmp_path / "sweep"
    first, second = (output / name for name in NAMES)

    # Interrupted (as by Ctrl-C) once the first run has finished.
    process = subprocess.Popen(
        sweep_command(config, output), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    wait_for(first / "summary.json", process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "rerun the same command" in stderr
    assert json.loads((first / "summary.json").read_text())["interrupted"] is False
    assert (output / "sweep.json").exists() and (output / "summary.md").exists()
    assert not (output / "sweep.lock").exists()
    finished_metrics = (first / "metrics.jsonl").read_bytes()
    finished_mtime = (first / "metrics.jsonl").stat().st_mtime_ns

    result = sweep(config, output)
    assert result.returncode == 0, result.stderr
    assert f"skipped run `{NAMES[0]}`: finished already" in result.stderr
    assert f"`{NAMES[0]}` started" not in result.stderr
    assert f"`{NAMES[1]}` started" in result.stderr
    assert (first / "metrics.jsonl").read_bytes() == finished_metrics
    assert (first / "metrics.jsonl").stat().st_mtime_ns == finished_mtime

    # Both runs finished, with their own names, seeds of the config, learning rates and steps.
    for directory, name in zip((first, second), NAMES, strict=True):
        summary = json.loads((directory / "summary.json").read_text())
        assert summary["name"] == name and summary["steps_completed"] == 2
        assert len((directory / "metrics.jsonl").read_text().splitlines()) == 2
    assert "learning_rate = 0.002" in (second / "config.toml").read_text()

    markdown = (output / "summary.md").read_text()
    assert markdown in result.stdout, "the table is printed"
    header = markdown.splitlines()[0]
    assert "train.learning_rate" in header and "final reward" in header and "tokens/s" in header
    rows = table_rows(markdown)
    assert [row[:4] for row in rows] == [
        [NAMES[0], "0.001", "finished", "2/2"],
        [NAMES[1], "0.002", "finished", "2/2"],
    ]
    for row in rows:
        assert all(cell != "" for cell in row), row  # rewards, throughput and wall time
    with (output / "summary.csv").open() as file:
        records = list(csv.DictReader(file))
    assert [r["run"] for r in records] == list(NAMES)
    assert all(float(r["tokens_per_second"]) > 0 and float(r["wall_seconds"]) > 0 for r in records)
    assert json.loads((output / "summary.json").read_text())[1]["values"] == {"train.learning_rate": "0.002"}

    html = (output / "report.html").read_text()
    assert all(f'data-run="{name}"' in html for name in NAMES)
    assert (output / "logs" / f"{NAMES[1]}.log").exists()

    # Everything finished: a third run of the command runs nothing.
    result = sweep(config, output)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("finished already") == 2


def test_another_grid_in_the_same_directory_and_a_bad_key_are_refused(
    tmp_path: Path,
    artifacts: Path,
) -> None:
    config = write_config(tmp_path, artifacts, steps=2)
    output = tmp_path / "sweep"
    output.mkdir()
    (output / "sweep.json").write_text(
        json.dumps(
            {
                "version": 1,
                "config": str(config),
                "config_hash": "0" * 64,
                "grid": [{"key": "train.learning_rate", "values": ["0.001"]}],
                "seeds": None,
                "overrides": ["run.steps=2"],
                "runs": [],
            }
        )
    )
    result = sweep(config, output)
    assert result.returncode == 1, result.stderr
    assert "holds another sweep" in result.stderr
    assert "the grid: it was --grid train.learning_rate=0.001, now" in result.stderr
    assert "the config" in result.stderr
    assert list(output.iterdir()) == [output / "sweep.json"], "nothing ran"

    result = sweep(config, tmp_path / "other", grid="train.lerning_rate=0.001,0.002")
    assert result.returncode == 2, result.stderr
    assert "--grid train.lerning_rate=0.001: --set " in result.stderr
    assert "did you mean `learning_rate`?" in result.stderr
    assert not (tmp_path / "other").exists()


def test_launch_runs_each_point_with_rollout_launch(
    tmp_path: Path,
    artifacts: Path,
) -> None:
    config = write_config(tmp_path, artifacts, cluster(1, 1), steps=2)
    output = tmp_path / "sweep"
    command = [*sweep_command(config, output, grid="rollout.temperature=1.0"), "--launch"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    log = (output / "logs" / "temperature=1.0.log").read_text()
    assert "controller for" in log and "listening on" in log, log[-3000:]
    assert table_rows((output / "summary.md").read_text())[0][:4] == [
        "temperature=1.0",
        "1.0",
        "finished",
        "2/2",
    ]
