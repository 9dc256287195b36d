"""End to end: rewards in the sandbox pool. A reward that hangs, raises, runs out of memory or
segfaults on some samples costs those samples, not the run; samples.jsonl says why each failed
and metrics.jsonl counts them exactly. Uses the torch-free toy policy, whose completions are
seeded digit strings, so the failing samples are known from their text."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.harness import read_jsonl, run, write_toy_config
from tests.fixtures.sandbox_plugins import BEHAVIOUR, PROGRAMS, expected_failure, program_for

STEPS = 4


def reward_config(directory: Path, *, reward: str, sandbox: dict) -> Path:
    """The toy config scored by `reward` alone, in the `sandbox` pool."""
    overrides = {"run.steps": STEPS, "rewards": [{"plugin": reward}], "sandbox": sandbox}
    return write_toy_config(directory, overrides, filename="sandbox.toml")


def test_hanging_raising_oom_and_crashing_rewards_cost_samples_not_the_run(tmp_path: Path) -> None:
    sandbox = {
        "processes": 2,
        "timeout_seconds": 1.0,
        "memory_mb": 2048,
        "max_failed_fraction": 0.9,
        "max_failed_fraction_per_step": 1.0,
    }
    config = reward_config(tmp_path, reward="sandbox_plugins:Misbehaving", sandbox=sandbox)
    started = time.monotonic()
    result = run(config, check=False, timeout=240)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 180
    samples = read_jsonl(tmp_path / "out" / "samples.jsonl")
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    assert len(samples) == STEPS * 3 * 4
    for sample in samples:
        expected = expected_failure(sample["completion"])
        failed = sample["failed"]
        assert (failed and failed["reason"]) == expected, sample
        if failed:
            assert sample["reward"] is None and sample["advantage"] == 0.0, sample
            # A worker that answered names the reward; one that hung or died cannot.
            assert failed.get("reward") == ("misbehaving" if expected in ("raised", "memory") else None)
        else:
            assert sample["reward"] == len(sample["completion"]), sample
    kinds = Counter(expected_failure(s["completion"]) for s in samples)
    assert all(kinds[reason] > 0 for reason in BEHAVIOUR.values()), (
        f"the seed must exercise every failure: {kinds}"
    )
    for line in metrics:
        step = [s for s in samples if s["step"] == line["step"]]
        counts = Counter(expected_failure(s["completion"]) for s in step)
        for reason in ("timeout", "raised", "memory", "crashed"):
            assert line[f"reward_failed_{reason}"] == counts[reason], (line["step"], reason)
        assert line["reward_failed_invalid"] == 0
        assert line["reward_failed"] == len(step) - counts[None]
        scored = [s["reward"] for s in step if not s["failed"]]
        if scored:
            assert line["reward_mean"] == pytest.approx(sum(scored) / len(scored))
    raised = next(s["failed"] for s in samples if s["failed"] and s["failed"]["reason"] == "raised")
    assert raised["message"].startswith("ValueError: reward refused")
    assert "Traceback (most recent call last)" in raised["traceback"]
    timeout = next(s["failed"] for s in samples if s["failed"] and s["failed"]["reason"] == "timeout")
    assert "timed out after 1 s" in timeout["message"]
    crashed = next(s["failed"] for s in samples if s["failed"] and s["failed"]["reason"] == "crashed")
    assert "SIGSEGV" in crashed["message"]


def test_too_many_failures_end_the_run_with_the_fraction_and_the_limit(tmp_path: Path) -> None:
    sandbox = {"processes": 1, "max_failed_fraction_per_step": 0.5}
    config = reward_config(tmp_path, reward="toy_plugins:RaisingReward", sandbox=sandbox)
    result = run(config, check=False, timeout=240)
    assert result.returncode == 1, result.stderr
    assert "rewards failed on 12 of 12 samples in this step (100.0%)" in result.stderr
    assert "sandbox.max_failed_fraction_per_step = 0.5" in result.stderr
    assert "reward exploded on purpose" in result.stderr


@pytest.mark.parametrize("processes", [0, 2])
def test_scores_are_clamped_to_the_rewards_declared_range(tmp_path: Path, processes: int) -> None:
    """`Bounded` declares [0, 1] but scores 1000 and more: in the
    interpreter and in the sandbox pool alike, every score counts as 1."""
    config = reward_config(tmp_path, reward="sandbox_plugins:Bounded", sandbox={"processes": processes})
    run(config)
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(metrics) == STEPS
    assert all(line["reward/bounded"] == 1.0 and line["reward_mean"] == 1.0 for line in metrics)


@pytest.mark.parametrize("processes", [0, 2])
def test_a_completion_that_breaks_the_code_reward_fails_alone(tmp_path: Path, processes: int) -> None:
    """`DigitsAsCode` runs a correct, a wrong or a channel-tampering program under bubblewrap,
    chosen by each completion's first digit: in the interpreter and in the sandbox pool alike,
    the tampering samples fail (not trained, counted by reason and by reward) and the run goes
    on with every other sample scored by its tests."""
    sandbox = {"processes": processes, "max_failed_fraction": 0.9, "max_failed_fraction_per_step": 1.0}
    config = reward_config(tmp_path, reward="sandbox_plugins:DigitsAsCode", sandbox=sandbox)
    run(config, timeout=240)
    samples = read_jsonl(tmp_path / "out" / "samples.jsonl")
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    firsts = Counter(sample["completion"][:1] for sample in samples)
    assert firsts["1"] > 0 and firsts["2"] > 0, f"the seed must give both programs: {firsts}"
    for sample in samples:
        tampering = program_for(sample["completion"]) == PROGRAMS["2"]
        failed = sample["failed"]
        if tampering:
            assert failed["reason"] == "crashed" and failed["reward"] == "digits_as_code", sample
            assert "broke the harness's channel" in failed["message"]
            assert sample["reward"] is None
        else:
            assert not failed, sample
            assert sample["reward"] == (1.0 if sample["completion"][:1] == "1" else 0.0), sample
    for line in metrics:
        tampered = sum(s["completion"][:1] == "2" for s in samples if s["step"] == line["step"])
        assert line["reward_failed_crashed"] == line["reward_failed"] == tampered
        assert line["reward_failed/digits_as_code"] == tampered
