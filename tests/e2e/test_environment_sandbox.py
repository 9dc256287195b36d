"""End to end: an environment in the sandbox pool. An environment that raises, hangs or ends its
process on some episodes costs those episodes (and the episodes whose state its killed process
held), not the run; samples.jsonl says why each failed and metrics.jsonl counts them exactly.
Uses the torch-free toy policy, whose turns are seeded digit strings, so which episodes fail,
and why, follows from the logged tokens."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.harness import FIXTURES, read_jsonl, run, write_toy_config
from tests.fixtures.sandbox_environments import expected_failure

STEPS = 3
PROCESSES = 3
EOS = 10  # the toy policy's end-of-sequence token
ANSWERS = {record["prompt"]: record["answer"] for record in read_jsonl(FIXTURES / "prompts.jsonl")}
REASONS = ("raised", "timeout", "crashed", "memory", "invalid", "restarted")
GUESS_NUMBER = {"plugin": "python_plugins.environments:GuessNumber", "options": {"max_turns": 2}}


def hostile(refuse: str) -> dict:
    """sandbox_environments:Hostile: its `reset` raises on records whose answer is `refuse`
    ("*": every record)."""
    return {"plugin": "sandbox_environments:Hostile", "options": {"refuse": refuse, "turns": 2}}


def environment_config(directory: Path, *, environment: dict, sandbox: dict) -> Path:
    """The toy config with a two-turn `environment` in the `sandbox` pool."""
    overrides = {
        "run": {"seed": 6, "steps": STEPS},
        "environment": {**environment, "max_turns": 2},
        "rollout.max_new_tokens": 3,
        "sandbox": sandbox,
    }
    return write_toy_config(directory, overrides, filename="environment_sandbox.toml")


def first_action(sample: dict) -> str:
    """The policy's first turn, decoded as the toy policy decodes."""
    turn = []
    for token, generated in zip(sample["tokens"], sample["generated"], strict=True):
        if generated:
            turn.append(token)
        elif turn:
            break
    return "".join(str(token % 10) for token in turn if token != EOS)


def expected_failures(step: list[dict]) -> list[tuple[str, str] | None]:
    """(hook, reason) per episode of one step, by the pool's documented rules: episode `i` lives
    in process `i % processes`; each process serves its episodes' first turns in order; the
    first that hangs or ends the process fails (timeout, crashed) and every other episode that
    process held fails as `restarted` (those after it at once, those before it at their next
    turn); a raise costs only its episode."""
    expected: list[tuple[str, str] | None] = [None] * len(step)
    lanes: list[list[int]] = [[] for _ in range(PROCESSES)]
    for index, sample in enumerate(step):
        if ANSWERS[sample["prompt"]] == "15":
            expected[index] = ("reset", "raised")
        else:
            lanes[index % PROCESSES].append(index)
    for lane in lanes:
        killed = False
        for index in lane:
            kind = expected_failure(first_action(step[index]))
            if killed:
                expected[index] = ("step", "restarted")
            elif kind is not None:
                expected[index] = ("step", kind)
                killed = kind in ("timeout", "crashed")
        for index in lane:
            if killed and expected[index] is None:
                expected[index] = ("step", "restarted")
    return expected


def test_raising_hanging_and_exiting_environments_cost_episodes_not_the_run(tmp_path: Path) -> None:
    sandbox = {
        "processes": PROCESSES,
        "timeout_seconds": 1.0,
        "max_failed_fraction": 1.0,
        "max_failed_fraction_per_step": 1.0,
    }
    config = environment_config(tmp_path, environment=hostile("15"), sandbox=sandbox)
    started = time.monotonic()
    result = run(config, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60
    samples = read_jsonl(tmp_path / "out" / "samples.jsonl")
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    assert len(samples) == STEPS * 3 * 4
    seen: Counter[tuple[str, str] | None] = Counter()
    for line in metrics:
        step = [s for s in samples if s["step"] == line["step"]]
        expected = expected_failures(step)
        seen.update(expected)
        for sample, want in zip(step, expected, strict=True):
            failed = sample["failed"]
            assert (failed and (failed["environment"], failed["reason"])) == want, (sample, want)
            if failed:
                assert sample["reward"] is None and sample["advantage"] == 0.0, sample
                assert "reward" not in failed, failed
            if want == ("reset", "raised"):
                assert sample["tokens"] == [] and sample["weight_version"] is None, sample
        counts = Counter(reason for _, reason in filter(None, expected))
        for reason in REASONS:
            assert line[f"environment_failed_{reason}"] == counts[reason], (line["step"], reason)
        assert line["environment_failed"] == sum(counts.values())
        assert line["reward_failed"] == 0
        # Failed episodes are not trained on: every other sample is a trained or skipped row.
        assert line["trained_rows"] + line["skipped_rows"] == len(step) - sum(counts.values())
    wanted = [("reset", "raised"), ("step", "raised"), ("step", "timeout"), ("step", "crashed")]
    wanted.append(("step", "restarted"))
    assert all(seen[kind] > 0 for kind in wanted), f"the seed must exercise every failure: {seen}"
    failures = [s["failed"] for s in samples if s["failed"]]
    by_reason = {(f["environment"], f["reason"]): f for f in failures}
    assert "Traceback (most recent call last)" in by_reason[("reset", "raised")]["traceback"]
    assert by_reason[("step", "raised")]["message"].startswith("ValueError: environment refused")
    assert "timed out after 1 s" in by_reason[("step", "timeout")]["message"]
    assert "exited with status 1" in by_reason[("step", "crashed")]["message"]
    assert "sandbox process holding this episode was restarted" in by_reason[("step", "restarted")]["message"]


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        pytest.param(
            {"max_failed_fraction": 1.0, "max_failed_fraction_per_step": 0.5},
            "environments failed on 12 of 12 samples in this step (100.0%), "
            "more than sandbox.max_failed_fraction_per_step = 0.5",
            id="per-step",
        ),
        pytest.param(
            {"max_failed_fraction": 0.25},
            "environments failed on 12 of 12 samples so far in the run (100.0%), "
            "more than sandbox.max_failed_fraction = 0.25",
            id="whole-run",
        ),
    ],
)
def test_too_many_failed_episodes_end_the_run_with_the_fraction_and_the_limit(
    tmp_path: Path, limits: dict, expected: str
) -> None:
    config = environment_config(tmp_path, environment=hostile("*"), sandbox={"processes": 1, **limits})
    result = run(config, check=False, timeout=120)
    assert result.returncode == 1, result.stderr
    assert expected in result.stderr
    assert "12 raised in the environment" in result.stderr
    assert "(environment `reset`): raised: ValueError: environment refused record" in result.stderr


def test_sandboxed_episodes_are_the_in_process_ones(tmp_path: Path) -> None:
    """Same seeds, same episodes: in the sandbox as in the embedded interpreter."""
    runs = {}
    for name, processes in [("in_process", 0), ("sandboxed", 2)]:
        directory = tmp_path / name
        directory.mkdir()
        config = environment_config(directory, environment=GUESS_NUMBER, sandbox={"processes": processes})
        result = run(config, check=False, timeout=120)
        assert result.returncode == 0, result.stderr
        runs[name] = read_jsonl(directory / "out" / "samples.jsonl")
    fields = ("prompt", "completion", "tokens", "generated", "reward", "advantage", "failed")
    assert [[s[f] for f in fields] for s in runs["sandboxed"]] == [
        [s[f] for f in fields] for s in runs["in_process"]
    ]
    assert len(runs["sandboxed"]) == STEPS * 3 * 4
    assert {s["prompt"][:26] for s in runs["sandboxed"]} == {"i am thinking of a number "}
