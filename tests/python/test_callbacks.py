"""ConsoleProgress and JsonlMetrics."""

import json

from python_plugins.callbacks import format_duration
from rollout_sdk import RunInfo
from rollout_sdk.testing import load_plugin


def run_info(start_step: int = 0, total_steps: int = 100) -> RunInfo:
    return RunInfo(
        name="test", output_dir="runs/test", total_steps=total_steps, start_step=start_step, config={}
    )


def metrics(step: int) -> dict:
    return {
        "step": step,
        "reward_mean": 0.4123,
        "loss": -0.00312,
        "completions": 128,
        "generated_tokens": 96,
        "step_seconds": 2.0,
        "samples_per_second": 1.94,
    }


def test_console_progress_prints_one_line_per_step(capsys):
    progress = load_plugin("python_plugins.callbacks:ConsoleProgress")
    progress.on_run_start(run_info())
    progress.on_step_end(12, metrics(12))
    progress.on_run_end({})
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step  12/100  reward 0.412  loss -0.0031  1.9 samples/s  48 tok/s  eta 2m56s"]


def test_console_progress_every_n_steps_and_the_last(capsys):
    progress = load_plugin("python_plugins.callbacks:ConsoleProgress", {"every": 5})
    progress.on_run_start(run_info(total_steps=12))
    for step in range(1, 13):
        progress.on_step_end(step, metrics(step))
    printed = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["5/12", "10/12", "12/12"]


def test_console_progress_shows_workers_joining_and_leaving(capsys):
    progress = load_plugin("python_plugins.callbacks:ConsoleProgress", {"every": 2})
    progress.on_run_start(run_info(total_steps=4))
    pool = [(3, 0, 0), (2, 0, 1), (3, 1, 0), (3, 0, 0)]
    for step, (workers, joined, lost) in enumerate(pool, start=1):
        progress.on_step_end(
            step, {**metrics(step), "workers": workers, "workers_joined": joined, "workers_lost": lost}
        )
    lines = capsys.readouterr().out.splitlines()
    assert "workers 2 (+0 -1)" in lines[0]
    assert "workers 3 (+1 -0)" in lines[1]


def test_console_progress_tolerates_missing_metrics(capsys):
    progress = load_plugin("python_plugins.callbacks:ConsoleProgress")
    progress.on_step_end(3, {})
    assert capsys.readouterr().out == "step 3\n"


def test_format_duration():
    assert [format_duration(s) for s in (4.4, 92, 3600 + 5 * 60 + 7)] == ["4s", "1m32s", "1h05m"]


def read_steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_jsonl_metrics_appends_and_flushes_each_step(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    callback = load_plugin("python_plugins.callbacks:JsonlMetrics", {"path": str(path)})
    callback.on_run_start(run_info())
    for step in (1, 2):
        callback.on_step_end(step, metrics(step))
        assert read_steps(path) == list(range(1, step + 1))
    callback.on_run_end({})
    assert json.loads(path.read_text().splitlines()[0]) == metrics(1)


def test_jsonl_metrics_keeps_only_the_chosen_fields(tmp_path):
    path = tmp_path / "metrics.jsonl"
    callback = load_plugin("python_plugins.callbacks:JsonlMetrics", {"path": str(path), "fields": ["loss"]})
    callback.on_run_start(run_info())
    callback.on_step_end(1, metrics(1))
    callback.on_run_end({})
    assert json.loads(path.read_text()) == {"step": 1, "loss": -0.00312}


def test_jsonl_metrics_resume_drops_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = load_plugin("python_plugins.callbacks:JsonlMetrics", {"path": str(path)})
    first.on_run_start(run_info())
    for step in range(1, 6):
        first.on_step_end(step, metrics(step))
    first.on_run_end({})
    with path.open("a") as torn:
        torn.write('{"step": 6, "rew')
    resumed = load_plugin("python_plugins.callbacks:JsonlMetrics", {"path": str(path)})
    resumed.on_run_start(run_info(start_step=3))
    assert read_steps(path) == [1, 2, 3]
    resumed.on_step_end(4, metrics(4))
    resumed.on_run_end({})
    assert read_steps(path) == [1, 2, 3, 4]


def test_jsonl_metrics_fresh_run_starts_empty(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    callback = load_plugin("python_plugins.callbacks:JsonlMetrics", {"path": str(path)})
    callback.on_run_start(run_info(start_step=0))
    callback.on_step_end(1, metrics(1))
    callback.on_run_end({})
    assert read_steps(path) == [1]
