"""End to end: `rollout launch` runs the controller, generation workers and trainer ranks as
separate processes of the same binary, connected by authenticated links on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.harness import (
    LAUNCH_TIMEOUT,
    POOL_METRICS,
    ROLLOUT,
    cluster,
    free_port,
    launch,
    learning_signal,
    metrics,
    run,
    samples,
    write_config,
)


def test_staleness_zero_with_one_worker_and_one_trainer_reproduces_rollout_run(
    tmp_path: Path, artifacts: Path
) -> None:
    local_dir, cluster_dir = tmp_path / "local", tmp_path / "cluster"
    local_dir.mkdir()
    cluster_dir.mkdir()
    # Same seed and config; the cluster section only matters to `rollout launch`.
    section = cluster(1, 1, 0)
    run(write_config(local_dir, artifacts, section, steps=4))
    launched = launch(write_config(cluster_dir, artifacts, section, steps=4))
    assert "started worker-0" in launched.stderr and "started trainer-0" in launched.stderr
    assert "torch threads per process" not in launched.stderr  # the policy sets torch_threads

    local, remote = metrics(local_dir), metrics(cluster_dir)
    assert [line["step"] for line in remote] == [1, 2, 3, 4]
    assert all(line["workers"] == 1 and line["leases"] == 2 for line in remote)
    pool = {name for line in remote for name in line if name in POOL_METRICS or name.startswith("worker_")}
    remote = [{k: v for k, v in line.items() if k not in pool} for line in remote]
    # Everything else but wall times is identical: rewards, losses, KL, lengths, versions.
    assert learning_signal(remote) == learning_signal(local)
    for line in remote:
        assert line["staleness_max"] == 0
        assert line["generation_weight_version"] == line["weight_version"] - 1


def test_generation_overlapping_training_in_one_process_reproduces_one_worker_and_one_trainer(
    tmp_path: Path, artifacts: Path
) -> None:
    """`rollout run` with `max_staleness = 1` generates on a copy of the policy on its own
    interpreter thread while the first copy trains: the same versions, samples and updates
    as `rollout launch` with one worker and one trainer."""
    local_dir, cluster_dir = tmp_path / "local", tmp_path / "cluster"
    local_dir.mkdir()
    cluster_dir.mkdir()
    section = cluster(1, 1, 1)
    local_config = write_config(local_dir, artifacts, section, steps=5)
    local_run = run(local_config)
    assert "generation copy" in local_run.stderr
    assert "share torch's" not in local_run.stderr  # the policy sets torch_threads = 1
    launch(write_config(cluster_dir, artifacts, section, steps=5))

    local, remote = metrics(local_dir), metrics(cluster_dir)
    pool = {name for line in remote for name in line if name in POOL_METRICS or name.startswith("worker_")}
    remote = [{k: v for k, v in line.items() if k not in pool} for line in remote]
    assert learning_signal(local) == learning_signal(remote)
    # Each step after the first was sampled while the one before it trained.
    assert [line["staleness_max"] for line in local] == [0, 1, 1, 1, 1]
    for line in local[1:]:
        assert line["generation_weight_version"] == line["weight_version"] - 2

    # Resumed, the copy is given the checkpoint's weights: the first step samples on them.
    resumed = run(local_config, "--resume", "--set", "run.steps=7")
    assert "resumed from" in resumed.stderr
    lines = metrics(local_dir)
    assert [line["step"] for line in lines] == list(range(1, 8))
    assert [line["staleness_max"] for line in lines[5:]] == [0, 1]
    assert lines[5]["generation_weight_version"] == lines[4]["weight_version"]


def test_processes_and_threads_computing_at_once_share_the_cores_when_the_policy_leaves_them_to_torch(
    tmp_path: Path, artifacts: Path
) -> None:
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    default = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    threads = int(default.stdout)
    left_to_torch = {"policy.options.torch_threads": None}
    local_dir, cluster_dir = tmp_path / "local", tmp_path / "cluster"
    local_dir.mkdir()
    cluster_dir.mkdir()
    # `rollout run`: the two copies of the policy split torch's threads.
    result = run(write_config(local_dir, artifacts, cluster(1, 1, 1), left_to_torch, steps=1), env=env)
    learner, generator = max(1, -(-threads // 2)), max(1, threads // 2)
    assert f"share torch's {threads} threads: {learner} training, {generator} generating" in result.stderr
    # `rollout launch`: two workers and a trainer rank, computing at once, split the cores.
    result = launch(write_config(cluster_dir, artifacts, cluster(2, 1, 1), left_to_torch, steps=1), env=env)
    cores = len(os.sched_getaffinity(0))
    each = max(1, cores // 3)
    assert f"{each} for each generation worker, {each} for each trainer rank" in result.stderr
    # Each role process was started with its share.
    started = re.findall(r"`([\w-]+)` connected to the controller [^\n]*OMP_NUM_THREADS=(\d+)", result.stderr)
    assert sorted(started) == [("trainer-0", str(each)), ("worker-0", str(each)), ("worker-1", str(each))]


def test_two_workers_two_trainers_overlap_generation_within_the_staleness_bound(
    tmp_path: Path, artifacts: Path
) -> None:
    powersgd = {"gradient_compression": "powersgd", "powersgd_rank": 2, "powersgd_warmup_updates": 2}
    config = write_config(
        tmp_path, artifacts, cluster(2, 2, 1, **powersgd), {"run.log_samples": 1000}, steps=6
    )
    result = launch(config)
    pids = {int(pid) for pid in re.findall(r"started \S+ \(pid (\d+)\)", result.stderr)}
    assert len(pids) == 4, result.stderr[-3000:]
    assert "trainer rank 1 of 2 joined the process group" in result.stderr

    lines = metrics(tmp_path)
    assert [line["step"] for line in lines] == list(range(1, 7))
    for line in lines:
        assert 0 <= line["staleness_max"] <= 1
    # The two SFT updates were PowerSGD's warm-up: every RL update sends low-rank factors,
    # and the ranks still agree on their weights (the controller compares them every publish).
    model_bytes = (artifacts / "model" / "model.safetensors").stat().st_size
    sent = [line["grad_allreduce_bytes"] for line in lines]
    assert all(0 < value < model_bytes / 4 for value in sent), (sent, model_bytes)
    logged = samples(tmp_path)
    assert len(logged) == 6 * 8
    lags = [s["trained_at_version"] - s["weight_version"] for s in logged]
    # The bound holds for every trained sample, and generation did run ahead of training.
    assert max(lags) <= 1 and min(lags) >= 0
    assert 1 in lags, "with max_staleness = 1 some step should be sampled during training"
    # Weight versions only grow along the run.
    versions = [line["weight_version"] for line in lines]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)


def test_a_raw_tcp_client_without_the_secret_is_dropped_unparsed(tmp_path: Path, artifacts: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, artifacts, cluster(1, 1, 0, listen=f"127.0.0.1:{port}"), steps=3)
    process = subprocess.Popen(
        [str(ROLLOUT), "launch", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                raw = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the controller never listened"
                assert process.poll() is None, process.communicate()[1]
                time.sleep(0.05)
        with raw:
            challenge = raw.recv(40)
            assert challenge.startswith(b"RLTAUTH1")
            # A frame preamble claiming a 64 GiB payload, then junk: none of it is parsed.
            raw.sendall(
                b"RLT\x01\x00\x04\x00\x00" + b"\x00" * 8 + b"\x00\x00\x00\x10\x00\x00\x00\x00" + b"x" * 64
            )
            raw.settimeout(10)
            try:
                answer = raw.recv(1024)
            except ConnectionResetError:
                answer = b""
            assert answer == b"", "the controller answered an unauthenticated peer"
        stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-4000:]
    assert "done: 3 steps" in stdout
    refusals = [line for line in stderr.splitlines() if "refused a connection" in line]
    assert len(refusals) == 1 and "not a Rollout peer" in refusals[0], stderr[-4000:]
    assert "GenerateRequest" not in refusals[0] and "frame" not in refusals[0]
    assert "panicked" not in stderr


def test_roles_started_elsewhere_need_the_secret(tmp_path: Path, artifacts: Path) -> None:
    config = write_config(tmp_path, artifacts, cluster(1, 1, 0), steps=1)
    result = launch(config, "--external-roles", check=False)
    assert result.returncode != 0
    assert "ROLLOUT_CLUSTER_SECRET" in result.stderr


def test_a_worker_with_the_wrong_secret_cannot_join(tmp_path: Path, artifacts: Path) -> None:
    port = free_port()
    section = cluster(1, 1, 0, listen=f"127.0.0.1:{port}", join_timeout_seconds=20)
    config = write_config(tmp_path, artifacts, section, steps=1)
    env = {"ROLLOUT_CLUSTER_SECRET": "the right secret, long enough", "PATH": "/usr/bin:/bin"}
    controller = subprocess.Popen(
        [str(ROLLOUT), "launch", str(config), "--external-roles"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    try:
        time.sleep(1.0)
        worker = subprocess.run(
            [str(ROLLOUT), "worker", "--connect", f"127.0.0.1:{port}", "--name", "intruder"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "ROLLOUT_CLUSTER_SECRET": "a wrong secret, also long enough"},
        )
        assert worker.returncode != 0
        assert "authentication failed" in worker.stderr
        _, stderr = controller.communicate(timeout=120)
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()
    assert controller.returncode != 0
    assert "does not know the cluster secret" in stderr
    assert "0 of 1 generation workers" in stderr


def test_tls_links_run_the_same_training(tmp_path: Path, artifacts: Path) -> None:
    config = write_config(tmp_path, artifacts, cluster(1, 1, 0, tls=True), steps=2)
    result = launch(config)
    assert "every link is encrypted" in result.stderr
    assert [line["step"] for line in metrics(tmp_path)] == [1, 2]


def test_ctrl_c_on_a_launched_run_checkpoints_and_resumes(tmp_path: Path, artifacts: Path) -> None:
    config = write_config(tmp_path, artifacts, cluster(1, 1, 0), steps=500)
    # A terminal's Ctrl-C goes to the whole foreground process group: here, the launcher's.
    process = subprocess.Popen(
        [str(ROLLOUT), "launch", str(config), "--set", "checkpoint.every=0"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics_file = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        metrics_file.exists() and metrics_file.read_text().count("\n") >= 2
    ):
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "lost" not in stderr, "the roles must outlive the Ctrl-C until the controller shuts them down"
    latest = (tmp_path / "out" / "checkpoints" / "latest").read_text().strip()
    state = json.loads((tmp_path / "out" / "checkpoints" / latest / "state.json").read_text())
    assert state["step"] == len(metrics(tmp_path)) >= 2
    resumed = launch(config, "--resume", "--set", f"run.steps={state['step'] + 1}")
    assert resumed.returncode == 0
    assert metrics(tmp_path)[-1]["step"] == state["step"] + 1
