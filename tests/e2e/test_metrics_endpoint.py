"""End to end: `[metrics] listen` serves Prometheus metrics at `/metrics` while a run goes on,
from `rollout run` and from the controller of `rollout launch` (with the roles' health)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.e2e.harness import (
    cluster,
    finish,
    free_port,
    gate,
    gate_config,
    metrics,
    pids,
    start,
    wait_for,
    write_config,
)

STEPS = 3
OPENMETRICS = "application/openmetrics-text"


def metrics_config(
    directory: Path, artifacts: Path, port: int, *overrides: dict, callbacks: tuple[dict, ...] = ()
) -> Path:
    """The e2e run with `/metrics` on `port`, held at each step's end while the gate exists
    (then `callbacks`)."""
    listen = {"metrics.listen": f"127.0.0.1:{port}"}
    return write_config(
        directory, artifacts, *overrides, listen, gate_config(directory, *callbacks), steps=STEPS
    )


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def parse(text: str) -> dict[str, float]:
    """`series{labels}` -> value, for every sample line of an OpenMetrics exposition."""
    assert text.rstrip().endswith("# EOF"), text[-500:]
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


def scrape(port: int) -> dict[str, float]:
    status, content_type, text = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200 and content_type.startswith(OPENMETRICS), (status, content_type)
    return parse(text)


def scrape_when(port: int, ready, process: subprocess.Popen, log: Path) -> dict[str, float]:
    """Scrapes until `ready(samples)` (the server answers once the run has started)."""
    found: dict[str, float] = {}

    def check() -> bool:
        nonlocal found
        try:
            found = scrape(port)
        except (urllib.error.URLError, ConnectionError):
            return False
        return ready(found)

    wait_for(check, process, log, "the expected /metrics")
    return found


def test_run_serves_step_reward_and_weight_version_while_it_runs(tmp_path: Path, artifacts: Path) -> None:
    port = free_port()
    config = metrics_config(tmp_path, artifacts, port)
    gate(tmp_path).touch()  # the run waits at the end of step 1 until the scrape is done
    process, log = start("run", config)
    try:
        found = scrape_when(port, lambda s: s.get("rollout_step") == 1, process, log)
        status, _, text = get(f"http://127.0.0.1:{port}/nothing")
        assert status == 404, text
    finally:
        gate(tmp_path).unlink(missing_ok=True)
    finish(process, log, steps=STEPS)
    first = metrics(tmp_path)[0]
    assert first["step"] == 1
    assert found["rollout_run_steps"] == STEPS
    assert found["rollout_steps_total"] == 1
    # Two SFT updates precede the first RL one: version 3, as metrics.jsonl says.
    assert found["rollout_weight_version"] == first["weight_version"] == 3
    assert found["rollout_generation_weight_version"] == first["generation_weight_version"]
    assert abs(found["rollout_reward_mean"] - first["reward_mean"]) < 1e-9
    assert 0.0 <= found["rollout_reward_mean"] <= 1.5
    assert found['rollout_reward_component{reward="exact_match"}'] == first["reward/exact_match"]
    assert found["rollout_completions_total"] == first["completions"] == 8
    assert found["rollout_generated_tokens_total"] == first["generated_tokens"]
    assert found["rollout_tokens_per_second"] > 0
    assert 0.0 < found["rollout_kv_cache_utilisation"] <= 1.0
    assert found["rollout_staleness_max"] == 0
    assert abs(found["rollout_last_step_timestamp_seconds"] - time.time()) < 300
    # One process: no role processes to report on.
    assert not [series for series in found if series.startswith("rollout_worker_up")]


def test_launch_serves_the_health_of_every_role_process(tmp_path: Path, artifacts: Path) -> None:
    port = free_port()
    # A second gate holds the run at the end of step 2 only.
    second_gate = tmp_path / "hold-step-2"
    hold_step_2 = {"plugin": "gate_plugins:HoldWhileFileExists", "options": {"path": second_gate, "step": 2}}
    config = metrics_config(tmp_path, artifacts, port, cluster(2, 1, 0), callbacks=(hold_step_2,))
    gate(tmp_path).touch()
    second_gate.touch()
    process, log = start("launch", config)
    w0, w1 = '{role="worker",worker="worker-0"}', '{role="worker",worker="worker-1"}'
    trainer = '{role="trainer",worker="trainer-0"}'
    try:
        found = scrape_when(port, lambda s: s.get("rollout_step") == 1, process, log)
        for role in (w0, w1, trainer):
            assert found[f"rollout_worker_up{role}"] == 1, json.dumps(found, indent=1)
            assert found[f"rollout_worker_joins_total{role}"] == 1
            assert found[f"rollout_worker_losses_total{role}"] == 0
            assert found[f"rollout_worker_restarts_total{role}"] == 0
            # Heartbeats every 2 s (cluster.heartbeat_seconds): heard from well within the timeout.
            assert 0.0 <= found[f"rollout_worker_last_heard_seconds{role}"] < 30
        assert found['rollout_worker_completions_total{worker="worker-0"}'] == 4
        assert found["rollout_weight_version"] == 3

        # Kill worker-0: rollout launch starts it again and it rejoins while the run is held.
        os.kill(pids(log, "worker-0")[0], signal.SIGKILL)
        restarted = scrape_when(port, lambda s: s.get(f"rollout_worker_joins_total{w0}") == 2, process, log)
        assert restarted[f"rollout_worker_restarts_total{w0}"] == 1
        assert restarted[f"rollout_worker_up{w0}"] == 1
        # On to the end of step 2: its generation or weight sync finds the old connection of
        # worker-0 lost; the new one stays up.
        gate(tmp_path).unlink()
        later = scrape_when(port, lambda s: s.get("rollout_step") == 2, process, log)
        assert later[f"rollout_worker_losses_total{w0}"] == 1, json.dumps(later, indent=1)
        assert later[f"rollout_worker_up{w0}"] == 1 and later[f"rollout_worker_up{w1}"] == 1
        assert later[f"rollout_worker_losses_total{w1}"] == 0
    finally:
        gate(tmp_path).unlink(missing_ok=True)
        second_gate.unlink(missing_ok=True)
    stderr = finish(process, log, steps=STEPS)
    assert f"serving Prometheus metrics at http://127.0.0.1:{port}/metrics" in stderr
