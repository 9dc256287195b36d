"""WandbTracker and TensorBoardTracker, called directly; what they wrote is read back with
wandb's own reader (`wandb leet inspect --json`) and TensorBoard's EventAccumulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from python_plugins.tracking import RUN_ID_FILE, SAMPLE_COLUMNS, markdown_table, scalar_metrics
from rollout_sdk import ConfigError, RunInfo
from rollout_sdk.testing import load_plugin
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

CONFIG = {"run": {"name": "unit", "steps": 4, "log_samples": 2}, "train": {"learning_rate": 0.001}}


@pytest.fixture(autouse=True)
def wandb_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No network, no prompts, nothing written outside the test's directory."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


# ---------------------------------------------------------------------------------------------
# Reading back what the trackers wrote


def run_info(output_dir: Path, start_step: int = 0, total_steps: int = 4, config: dict = CONFIG) -> RunInfo:
    return RunInfo(
        name="unit", output_dir=str(output_dir), total_steps=total_steps, start_step=start_step, config=config
    )


def step_metrics(step: int, scale: float = 1.0) -> dict:
    return {
        "step": step,
        "reward_mean": scale * step / 10,
        "loss": -scale * step / 100,
        "reward/exact_match": scale * step / 20,
        "completions": 8,
        "worker_completions/worker-0": 8.0,
        "note": "not a number",
        "missing": None,
    }


def step_samples(step: int) -> list[dict]:
    return [
        {
            "step": step,
            "group": 0,
            "prompt": f"{step}+1=",
            "completion": f"{step + 1}|x\ny" if index else str(step + 1),
            "reward": None if index else 1.5,
            "advantage": 0.5 - index,
            "tokens": [1, 2, 3],
        }
        for index in range(2)
    ]


def drive(tracker, output_dir: Path, steps: range, *, start_step: int = 0, scale: float = 1.0) -> None:
    """on_run_start, then per step the engine's order: samples.jsonl, then on_step_end."""
    output_dir.mkdir(parents=True, exist_ok=True)
    tracker.on_run_start(run_info(output_dir, start_step=start_step))
    for step in steps:
        with (output_dir / "samples.jsonl").open("a") as file:
            file.writelines(json.dumps(sample) + "\n" for sample in step_samples(step))
        tracker.on_step_end(step, step_metrics(step, scale))
    tracker.on_run_end({"steps_completed": steps[-1], "interrupted": False, "checkpoint": "ck"})


# ---------------------------------------------------------------------------------------------
# TensorBoard


def test_tensorboard_logs_each_step_metrics_config_and_sample_tables(tmp_path: Path):
    out = tmp_path / "out"
    tracker = load_plugin("python_plugins.tracking:TensorBoardTracker", {"log_samples_every": 2})
    drive(tracker, out, range(1, 5))

    events = tensorboard(out / "tensorboard")
    assert set(events.Tags()["scalars"]) == {
        "reward_mean",
        "loss",
        "reward/exact_match",
        "completions",
        "worker_completions/worker-0",
    }
    assert scalars(events, "reward_mean") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4})
    assert scalars(events, "loss") == pytest.approx({1: -0.01, 2: -0.02, 3: -0.03, 4: -0.04})
    assert scalars(events, "completions") == {1: 8.0, 2: 8.0, 3: 8.0, 4: 8.0}

    config = texts(events, "config")
    assert list(config) == [0]
    assert json.loads(config[0].replace("\n    ", "\n")) == CONFIG

    tables = texts(events, "samples")
    assert list(tables) == [2, 4]
    assert tables[4] == markdown_table(step_samples(4))
    lines = tables[4].splitlines()
    assert lines[0] == "| " + " | ".join(SAMPLE_COLUMNS) + " |"
    assert lines[2] == "| 4 | 4+1= | 5 | 1.5 | 0.5 |"
    assert lines[3] == "| 4 | 4+1= | 5\\|x<br>y |  | -0.5 |"


def test_tensorboard_resume_drops_the_steps_after_the_checkpoint(tmp_path: Path):
    out = tmp_path / "out"
    first = load_plugin("python_plugins.tracking:TensorBoardTracker")
    drive(first, out, range(1, 5))
    # Resumed from the checkpoint of step 2: steps 3 and 4 are redone (here with other values).
    resumed = load_plugin("python_plugins.tracking:TensorBoardTracker")
    drive(resumed, out, range(3, 5), start_step=2, scale=10.0)

    events = tensorboard(out / "tensorboard")
    assert scalars(events, "reward_mean") == pytest.approx({1: 0.1, 2: 0.2, 3: 3.0, 4: 4.0})
    assert [event.step for event in events.Scalars("loss")] == [1, 2, 3, 4]


def test_tensorboard_log_dir_option(tmp_path: Path):
    log_dir = tmp_path / "elsewhere"
    tracker = load_plugin("python_plugins.tracking:TensorBoardTracker", {"log_dir": str(log_dir)})
    drive(tracker, tmp_path / "out", range(1, 3))
    assert scalars(tensorboard(log_dir), "reward_mean") == pytest.approx({1: 0.1, 2: 0.2})
    assert not (tmp_path / "out" / "tensorboard").exists()


# ---------------------------------------------------------------------------------------------
# Sample tables: when, and from what


def test_sample_tables_default_to_every_tenth_step_and_the_last(tmp_path: Path):
    out = tmp_path / "out"
    tracker = load_plugin("python_plugins.tracking:TensorBoardTracker")
    out.mkdir()
    tracker.on_run_start(run_info(out, total_steps=25))
    for step in range(1, 26):
        with (out / "samples.jsonl").open("a") as file:
            file.writelines(json.dumps(sample) + "\n" for sample in step_samples(step))
        tracker.on_step_end(step, step_metrics(step))
    tracker.on_run_end({})
    assert list(texts(tensorboard(out / "tensorboard"), "samples")) == [10, 20, 25]


def test_no_sample_tables_without_run_log_samples(tmp_path: Path, capsys):
    no_samples = {"run": {"log_samples": 0}}
    # Not asked for: nothing logged, nothing said.
    quiet = load_plugin("python_plugins.tracking:TensorBoardTracker", {"log_dir": str(tmp_path / "a")})
    quiet.on_run_start(run_info(tmp_path, config=no_samples))
    quiet.on_step_end(1, step_metrics(1))
    quiet.on_run_end({})
    assert capsys.readouterr().err == ""
    assert texts(tensorboard(tmp_path / "a"), "samples") == {}
    # Asked for: a warning that says why there are none.
    asked = load_plugin(
        "python_plugins.tracking:TensorBoardTracker",
        {"log_dir": str(tmp_path / "b"), "log_samples_every": 1},
    )
    asked.on_run_start(run_info(tmp_path, config=no_samples))
    asked.on_step_end(1, step_metrics(1))
    asked.on_run_end({})
    assert "run.log_samples = 0" in capsys.readouterr().err
    assert texts(tensorboard(tmp_path / "b"), "samples") == {}


def test_sample_tables_read_only_the_steps_samples_and_complete_lines(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    # Left by the interrupted run up to its checkpoint: not this run's samples.
    (out / "samples.jsonl").write_text(json.dumps({**step_samples(2)[0], "completion": "old"}) + "\n")
    tracker = load_plugin("python_plugins.tracking:TensorBoardTracker", {"log_samples_every": 1})
    tracker.on_run_start(run_info(out, start_step=2))
    with (out / "samples.jsonl").open("a") as file:
        file.writelines(json.dumps(sample) + "\n" for sample in step_samples(3))
        file.write('{"step": 4, "prompt": "half a li')
    tracker.on_step_end(3, step_metrics(3))
    tracker.on_run_end({})
    (table,) = texts(tensorboard(out / "tensorboard"), "samples").values()
    assert table == markdown_table(step_samples(3))


def test_scalar_metrics_keeps_numbers_but_the_step():
    assert scalar_metrics(step_metrics(3)) == {
        "reward_mean": pytest.approx(0.3),
        "loss": pytest.approx(-0.03),
        "reward/exact_match": pytest.approx(0.15),
        "completions": 8.0,
        "worker_completions/worker-0": 8.0,
    }


# ---------------------------------------------------------------------------------------------
# Weights & Biases (offline)


def test_wandb_offline_run_holds_config_step_metrics_and_sample_tables(tmp_path: Path):
    out = tmp_path / "out"
    options = {"project": "unit-tests", "tags": ["a", "b"], "log_samples_every": 2}
    tracker = load_plugin("python_plugins.tracking:WandbTracker", options)
    drive(tracker, out, range(1, 5))

    (run_dir,) = wandb_run_dirs(out)
    run_id = (out / RUN_ID_FILE).read_text().strip()
    assert run_id in run_dir.name
    records = wandb_records(run_dir)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "unit-tests" and run["display_name"] == "unit" and run["run_id"] == run_id
    assert run["tags"] == ["a", "b"]
    assert {k: v for k, v in wandb_config(records).items() if k != "_wandb"} == CONFIG

    history = wandb_history(records)
    assert sorted(history) == [1, 2, 3, 4]
    for step, item in history.items():
        assert item["reward_mean"] == pytest.approx(step / 10)
        assert item["loss"] == pytest.approx(-step / 100)
        assert item["reward/exact_match"] == pytest.approx(step / 20)
        assert item["worker_completions/worker-0"] == 8
        assert "note" not in item and "missing" not in item
    assert [step for step, item in history.items() if "samples.path" in item] == [2, 4]
    table = wandb_table(run_dir, history[4])
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert table["data"] == [[s[c] for c in SAMPLE_COLUMNS] for s in step_samples(4)]

    summary = {}
    for record in records:
        if record["type"] == "summary":
            summary |= record["summary"].get("update", {})
    assert summary["run/steps_completed"] == 4 and summary["run/checkpoint"] == "ck"
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]


def test_wandb_resumed_run_continues_the_same_wandb_run(tmp_path: Path):
    out = tmp_path / "out"
    drive(load_plugin("python_plugins.tracking:WandbTracker"), out, range(1, 5))
    run_id = (out / RUN_ID_FILE).read_text().strip()
    drive(load_plugin("python_plugins.tracking:WandbTracker"), out, range(3, 5), start_step=2, scale=10.0)

    # wandb writes each session of a run to its own offline directory (`wandb sync` takes both).
    sessions = [wandb_records(run_dir) for run_dir in wandb_run_dirs(out)]
    runs = [next(r["run"] for r in records if r["type"] == "run") for records in sessions]
    assert [run["run_id"] for run in runs] == [run_id, run_id]
    (resumed,) = [records for records, run in zip(sessions, runs, strict=True) if run.get("resume")]
    assert {s: i["reward_mean"] for s, i in wandb_history(resumed).items()} == pytest.approx({3: 3.0, 4: 4.0})

    # A fresh run in the same output_dir (`--overwrite`) is a new W&B run.
    fresh = load_plugin("python_plugins.tracking:WandbTracker")
    drive(fresh, out, range(1, 2))
    assert (out / RUN_ID_FILE).read_text().strip() != run_id
    assert len(wandb_run_dirs(out)) == 3


def test_wandb_is_offline_by_default_and_the_dir_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("WANDB_MODE")
    elsewhere = tmp_path / "elsewhere"
    tracker = load_plugin("python_plugins.tracking:WandbTracker", {"dir": str(elsewhere)})
    drive(tracker, tmp_path / "out", range(1, 2))
    (run_dir,) = wandb_run_dirs(elsewhere)
    assert sorted(wandb_history(wandb_records(run_dir))) == [1]
    assert not (tmp_path / "out" / "wandb").exists()


def test_wandb_disabled_by_option_or_environment_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    disabled = load_plugin("python_plugins.tracking:WandbTracker", {"mode": "disabled"})
    drive(disabled, tmp_path / "option", range(1, 3))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    drive(load_plugin("python_plugins.tracking:WandbTracker"), tmp_path / "env", range(1, 3))
    for out in (tmp_path / "option", tmp_path / "env"):
        assert sorted(path.name for path in out.iterdir()) == ["samples.jsonl"]


# ---------------------------------------------------------------------------------------------
# Options


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("WandbTracker", {"mode": "shared"}, "must be one of"),
        ("WandbTracker", {"log_samples_every": -1}, "at least 0"),
        ("TensorBoardTracker", {"log_samples_every": -2}, "at least 0"),
        ("TensorBoardTracker", {"logdir": "x"}, "did you mean `log_dir`"),
    ],
)
def test_bad_options_are_config_errors(spec: str, options: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        load_plugin(f"python_plugins.tracking:{spec}", options)


def test_a_multi_agent_runs_sample_table_names_the_agent() -> None:
    solver = {"step": 1, "agent": "solver", "prompt": "3+4=", "completion": "7", "reward": 1.0}
    proposer = {"step": 1, "agent": "proposer", "prompt": "sum: ", "completion": "3+4", "reward": 1.25}
    samples = [{**solver, "advantage": 0.5}, {**proposer, "advantage": -0.5}]
    header, _, first, second = markdown_table(samples).splitlines()
    assert header == "| agent | " + " | ".join(SAMPLE_COLUMNS) + " |"
    assert first.startswith("| solver | 1 | 3+4= | 7 |")
    assert second.startswith("| proposer |")
    assert "agent" not in markdown_table([{k: v for k, v in s.items() if k != "agent"} for s in samples])
