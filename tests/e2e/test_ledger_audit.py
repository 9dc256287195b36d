"""The ledger's audit proves what it says: after a run whose workers were stopped and killed
until groups were dropped, `rollout audit --groups` lists exactly the groups of
`samples.jsonl`, step by step and prompt by prompt; dropped groups are counted apart, and
their prompts were trained by later steps.

With one lease per group (`max_attempts = 1`), a worker stopped with SIGSTOP makes the group
it holds (or is dealt next) be dropped once its silence is noticed; it is then killed with
SIGKILL and `rollout launch` starts it again. Whether churn also delivers a group past the
staleness bound (regenerated, counted as replaced) cannot be forced through the binary:
`crates/rollout-core/tests/audit.rs` forces it with fake workers; here the audit's replaced
groups are checked against `stale_groups_regenerated`, whatever their number."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from tests.e2e.harness import (
    audit,
    cluster,
    finish,
    gate,
    gate_config,
    metrics,
    pids,
    samples,
    start,
    wait_for,
    write_config,
)

STEPS = 14
PROMPTS_PER_STEP = 2
GROUP_SIZE = 4
STALENESS = 1
# Stop-and-kill cycles at most, until a group was dropped (the first one drops one).
CYCLES = 3


def steps_done(directory: Path) -> int:
    path = directory / "out" / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def dropped_so_far(directory: Path) -> int:
    journal = directory / "out" / "ledger.jsonl"
    return journal.read_text().count('"event":"abandoned"') if journal.exists() else 0


def stop_and_kill(directory: Path, process: subprocess.Popen[str], log: Path, cycle: int) -> None:
    """Stops worker-0 until the pool finds it silent (what it held or was dealt meanwhile is
    dropped), then kills it and holds the run until `rollout launch` has it back."""
    victim = pids(log, "worker-0")[-1]

    def count(line: str) -> int:
        return log.read_text().count(line)

    left = count("worker-0 left the generation pool")
    os.kill(victim, signal.SIGSTOP)
    try:
        noticed = f"worker-0 found silent (cycle {cycle})"
        wait_for(lambda: count("worker-0 left the generation pool") > left, process, log, noticed, seconds=60)
    finally:
        gate(directory).touch()
        os.kill(victim, signal.SIGKILL)
    back = f"worker-0 restarted (cycle {cycle})"
    wait_for(
        lambda: count("worker-0 joined the run's generation workers") > cycle, process, log, back, seconds=120
    )
    gate(directory).unlink()


def questions(artifacts: Path) -> list[str]:
    """The prompt of each record of the data (the base config's template is "{question}")."""
    lines = (artifacts / "data" / "train.jsonl").read_text().splitlines()
    return [json.loads(line)["question"] for line in lines if line.strip()]


def test_killed_workers_dropped_groups_are_requeued_and_the_audit_matches_samples(
    tmp_path: Path, artifacts: Path
) -> None:
    timing = {"heartbeat_seconds": 0.5, "peer_timeout_seconds": 3, "max_attempts": 1}
    config = write_config(
        tmp_path,
        artifacts,
        cluster(2, 1, STALENESS, **timing),
        gate_config(tmp_path),
        {"run.log_samples": 1000, "rollout.max_new_tokens": 24},
        steps=STEPS,
    )
    process, log = start("launch", config)
    try:
        wait_for(lambda: steps_done(tmp_path) >= 2, process, log, "step 2")
        for cycle in range(CYCLES):
            stop_and_kill(tmp_path, process, log, cycle)
            if dropped_so_far(tmp_path):
                break
    finally:
        gate(tmp_path).unlink(missing_ok=True)
    finish(process, log, STEPS)

    found = audit(tmp_path / "out", "--groups")
    assert found["groups_lost"] == 0 and found["groups_duplicated"] == 0, found
    prompts = questions(artifacts)
    logged: dict[tuple[int, int], list[str]] = {}
    for sample in samples(tmp_path):
        logged.setdefault((sample["step"], sample["group"]), []).append(sample["prompt"])
    assert {len(group) for group in logged.values()} == {GROUP_SIZE}
    # Group by group: what each update trained is what samples.jsonl logged, on the same prompt.
    audited = {
        (step["step"], group["group"]): prompts[group["record"]]
        for step in found["steps"]
        for group in step["trained"]
    }
    assert audited == {key: group[0] for key, group in logged.items()}
    assert found["groups_trained"] == len(logged), found

    lines = metrics(tmp_path)
    assert found["groups_dropped_attempts"] >= 1, found
    assert found["groups_dropped_attempts"] == sum(line["groups_dropped"] for line in lines), found
    assert found["groups_replaced"] == sum(line["stale_groups_regenerated"] for line in lines), found
    assert found["groups_dropped_stale"] == sum(line["stale_groups_dropped"] for line in lines), found
    per_step = [sum(1 for step, _ in logged if step == s) for s in range(1, STEPS + 1)]
    assert sum(per_step) + found["groups_dropped"] == STEPS * PROMPTS_PER_STEP, (per_step, found)

    # Every dropped prompt went back to the data queue and a later step trained it: the
    # redrawn group carries the dropped group's record.
    assert found["groups_requeued"] == found["groups_dropped"] and found["prompts_lost"] == 0, found
    dropped = {
        (step["step"], group["group"]): (group["record"], step["step"] + 1 + STALENESS <= STEPS)
        for step in found["steps"]
        for group in step["dropped"]
    }
    redrawn = {
        (group["from"]["step"], group["from"]["index"]): (step["step"], group["group"])
        for step in found["steps"]
        for group in step["redrawn"]
    }
    due = {key for key, (_, drawable) in dropped.items() if drawable}
    assert set(redrawn) == due, (redrawn, dropped)
    for origin, trained_as in redrawn.items():
        assert logged[trained_as][0] == prompts[dropped[origin][0]], (origin, trained_as)
    assert found["requeued_pending"] == len(dropped) - len(due)
