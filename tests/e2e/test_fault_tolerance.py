"""Generation workers that die, drain or join mid-run: the run goes on, and the controller's
ledger proves every prompt group was trained exactly once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.test_distributed import LAUNCH_TIMEOUT, POOL_METRICS, cluster, free_port, samples
from tests.e2e.test_rollout_binary import ROLLOUT, artifacts, learning_signal, metrics, write_config

__all__ = ["artifacts"]

STEPS = 60
PROMPTS_PER_STEP = 2
GROUP_SIZE = 4


def start(config: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    log = config.parent / "launch.log"
    process = subprocess.Popen(
        [str(ROLLOUT), "launch", str(config), *args],
        cwd=config.parent,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env=env,
    )
    return process, log


def wait_for(predicate, process: subprocess.Popen, log: Path, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert process.poll() is None, f"the run ended before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} after {seconds} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)


def steps_done(directory: Path) -> int:
    path = directory / "out" / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def finish(process: subprocess.Popen, log: Path, steps: int = STEPS) -> str:
    try:
        stdout, _ = process.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = log.read_text()
    assert process.returncode == 0, stderr[-4000:]
    assert f"done: {steps} steps" in stdout
    assert "panicked" not in stderr
    return stderr


def audit(directory: Path) -> dict:
    result = subprocess.run(
        [str(ROLLOUT), "audit", str(directory / "out")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def assert_every_group_trained_once(directory: Path, steps: int = STEPS) -> dict:
    found = audit(directory)
    assert found["groups_lost"] == 0 and found["groups_duplicated"] == 0, found
    assert found["groups_trained"] == steps * PROMPTS_PER_STEP, found
    logged = samples(directory)
    per_group: dict[tuple[int, int], int] = {}
    for sample in logged:
        key = (sample["step"], sample["group"])
        per_group[key] = per_group.get(key, 0) + 1
    assert sorted(per_group) == [(s, g) for s in range(1, steps + 1) for g in range(PROMPTS_PER_STEP)]
    assert set(per_group.values()) == {GROUP_SIZE}
    return found


def pids(log: Path, role: str) -> list[int]:
    return [int(pid) for pid in re.findall(rf"started {role} \(pid (\d+)\)", log.read_text())]


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def gate(directory: Path) -> Path:
    """While this file exists the run waits at its next step boundary (see gate_config)."""
    return directory / "hold"


def gate_config(directory: Path) -> str:
    return f"""
[python]
paths = ["{FIXTURES}"]

[[callbacks]]
plugin = "gate_plugins:HoldWhileFileExists"
options = {{ path = "{gate(directory)}" }}
"""


def fault_config(directory: Path, artifacts: Path, workers: int, extra: str = "", steps: int = STEPS) -> Path:
    config = write_config(
        directory, artifacts, steps=steps, extra=cluster(workers, 1, 0, extra) + gate_config(directory)
    )
    text = config.read_text().replace("[run]\n", "[run]\nlog_samples = 1000\n", 1)
    # Long completions keep a worker busy, so a kill lands while it holds leases.
    config.write_text(text.replace("max_new_tokens = 4", "max_new_tokens = 24"))
    return config


def test_a_killed_worker_is_restarted_and_no_group_is_lost(tmp_path: Path, artifacts: Path) -> None:
    process, log = start(fault_config(tmp_path, artifacts, 2))
    wait_for(lambda: steps_done(tmp_path) >= 2, process, log, "step 2")
    victim = pids(log, "worker-0")[0]
    os.kill(victim, signal.SIGKILL)
    gate(tmp_path).touch()  # however fast the steps, the run waits for the restarted worker
    rejoined = "worker-0 joined the run's generation workers"
    wait_for(lambda: rejoined in log.read_text(), process, log, "a restarted worker-0")
    gate(tmp_path).unlink()
    stderr = finish(process, log)
    assert "worker-0 exited with signal: 9" in stderr and "starting it again" in stderr
    lines = metrics(tmp_path)
    assert sum(line["workers_lost"] for line in lines) >= 1
    assert sum(line["workers_joined"] for line in lines) >= 1, "the restarted worker never rejoined"
    assert lines[-1]["workers"] == 2
    assert_every_group_trained_once(tmp_path)


def test_sigterm_drains_a_worker_and_the_run_goes_on_without_it(tmp_path: Path, artifacts: Path) -> None:
    process, log = start(fault_config(tmp_path, artifacts, 2))
    wait_for(lambda: steps_done(tmp_path) >= 2, process, log, "step 2")
    drained = pids(log, "worker-1")[0]
    os.kill(drained, signal.SIGTERM)
    stderr = finish(process, log)
    assert "draining" in stderr and "worker-1 left the run" in stderr
    assert len(pids(log, "worker-1")) == 1, "a drained worker must not be restarted"
    lines = metrics(tmp_path)
    assert lines[-1]["workers"] == 1
    assert_every_group_trained_once(tmp_path)


def test_a_worker_started_mid_run_pulls_the_weights_and_gets_work(tmp_path: Path, artifacts: Path) -> None:
    port = free_port()
    secret = tmp_path / "secret"
    secret.write_text("a cluster secret for this test only")
    config = fault_config(tmp_path, artifacts, 1, f'listen = "127.0.0.1:{port}"\nsecret_file = "{secret}"')
    process, log = start(config)
    late = None
    try:
        wait_for(lambda: steps_done(tmp_path) >= 2, process, log, "step 2")
        gate(tmp_path).touch()
        late = subprocess.Popen(
            [str(ROLLOUT), "worker", "--connect", f"127.0.0.1:{port}", "--name", "latecomer"],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "ROLLOUT_CLUSTER_SECRET": secret.read_text()},
        )
        joined = "latecomer joined the run's generation workers"
        wait_for(lambda: joined in log.read_text(), process, log, "the late worker")
        gate(tmp_path).unlink()
        stderr = finish(process, log)
        late_stderr = late.communicate(timeout=60)[1]
    finally:
        if late is not None and late.poll() is None:
            late.kill()
            late.wait()
    assert late.returncode == 0, late_stderr[-3000:]
    assert "latecomer joined the run's generation workers" in stderr
    lines = metrics(tmp_path)
    joined_at = next(line["step"] for line in lines if line["workers_joined"] >= 1)
    assert all(line["workers"] == 2 for line in lines if line["step"] > joined_at)
    assert any(line.get("worker_completions/latecomer", 0) > 0 for line in lines)
    assert_every_group_trained_once(tmp_path)


def test_a_stopped_worker_is_found_by_its_silence_and_its_groups_leased_again(
    tmp_path: Path, artifacts: Path
) -> None:
    extra = "heartbeat_seconds = 0.5\npeer_timeout_seconds = 3"
    process, log = start(fault_config(tmp_path, artifacts, 2, extra))
    wait_for(lambda: steps_done(tmp_path) >= 2, process, log, "step 2")
    hung = pids(log, "worker-1")[0]
    os.kill(hung, signal.SIGSTOP)
    try:
        noticed = "worker-1 left the generation pool"
        wait_for(lambda: noticed in log.read_text(), process, log, "the hang noticed")
    finally:
        os.kill(hung, signal.SIGCONT)
    stderr = finish(process, log)
    assert "sent nothing" in stderr or "did not answer" in stderr, stderr[-3000:]
    assert sum(line["workers_lost"] for line in metrics(tmp_path)) >= 1
    assert_every_group_trained_once(tmp_path)


SHORT = 10


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, artifacts: Path) -> list[dict]:
    """The learning signal of a 1-worker, 1-trainer run that nothing interrupts."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    process, log = start(fault_config(directory, artifacts, 1, steps=SHORT))
    finish(process, log, SHORT)
    return signal_of(directory)


def signal_of(directory: Path) -> list[dict]:
    return [
        {k: v for k, v in line.items() if k not in POOL_METRICS and not k.startswith("worker_completions/")}
        for line in learning_signal(metrics(directory))
    ]


def wait_exit(pid: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)


def test_a_killed_trainer_restarts_the_run_from_its_checkpoint_exactly(
    tmp_path: Path, artifacts: Path, uninterrupted: list[dict]
) -> None:
    process, log = start(fault_config(tmp_path, artifacts, 1, steps=SHORT))
    wait_for(lambda: steps_done(tmp_path) >= 5, process, log, "step 5")
    os.kill(pids(log, "trainer-0")[0], signal.SIGKILL)
    stderr = finish(process, log, SHORT)
    assert "restarting every role from the last checkpoint (1 of 3)" in stderr
    assert len(pids(log, "trainer-0")) == 2
    # No half-applied step: the run from the checkpoint is the run that was never killed.
    assert signal_of(tmp_path) == uninterrupted
    assert assert_every_group_trained_once(tmp_path, SHORT)["rollbacks"] == 1


def test_a_killed_controller_resumes_with_no_group_lost_or_repeated(
    tmp_path: Path, artifacts: Path, uninterrupted: list[dict]
) -> None:
    config = fault_config(tmp_path, artifacts, 1, steps=SHORT)
    process, log = start(config)
    wait_for(lambda: steps_done(tmp_path) >= 5, process, log, "step 5")
    roles = pids(log, "worker-0") + pids(log, "trainer-0")
    process.kill()
    process.wait()
    for pid in roles:
        wait_exit(pid)
    resumed, resumed_log = start(config, "--resume")
    finish(resumed, resumed_log, SHORT)
    assert signal_of(tmp_path) == uninterrupted
    assert assert_every_group_trained_once(tmp_path, SHORT)["rollbacks"] == 1
