"""End to end: an environment in the sandbox pool. An environment that raises, hangs or ends its
process on some episodes costs those episodes (and the episodes whose state its killed process
held), not the run; samples.jsonl says why each failed and metrics.jsonl counts them exactly.
Uses the torch-free toy policy, whose turns are seeded digit strings, so which episodes fail,
and why, follows from the logged tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
ROLLOUT = Path(os.environ.get("ROLLOUT_BIN", REPO / "target" / "release" / "rollout"))
sys.path.insert(0, str(FIXTURES))

from sandbox_environments import expected_failure  # noqa: E402

STEPS = 3
PROCESSES = 3
EOS = 10  # the toy policy's end-of-sequence token
ANSWERS = {
    record["prompt"]: record["answer"]
    for record in map(json.loads, (FIXTURES / "prompts.jsonl").read_text().splitlines())
}
REASONS = ("raised", "timeout", "crashed", "memory", "invalid", "restarted")


def write_config(directory: Path, *, refuse: str, sandbox: str, environment: str = "") -> Path:
    environment = (
        environment
        or f'plugin = "sandbox_environments:Hostile"\noptions = {{ refuse = "{refuse}", turns = 2 }}'
    )
    text = f"""
[run]
output_dir = "{directory / "out"}"
seed = 6
steps = {STEPS}
log_samples = 1000

[python]
paths = ["{FIXTURES}"]

[policy]
plugin = "toy_plugins:ToyPolicy"

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{FIXTURES / "prompts.jsonl"}" }}

[environment]
{environment}
max_turns = 2

[[rewards]]
plugin = "toy_plugins:DigitSum"

[rollout]
prompts_per_step = 3
group_size = 4
max_new_tokens = 3

[train]
learning_rate = 0.001

[sandbox]
{sandbox}
"""
    path = directory / "environment_sandbox.toml"
    path.write_text(text)
    return path


def run(config: Path) -> subprocess.CompletedProcess[str]:
    if not ROLLOUT.exists():
        pytest.fail(f"{ROLLOUT} is missing: build it (or set ROLLOUT_BIN)")
    return subprocess.run(
        [str(ROLLOUT), "run", str(config)], capture_output=True, text=True, cwd=config.parent, timeout=120
    )


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    sandbox = (
        f"processes = {PROCESSES}\ntimeout_seconds = 1.0\n"
        "max_failed_fraction = 1.0\nmax_failed_fraction_per_step = 1.0"
    )
    config = write_config(tmp_path, refuse="15", sandbox=sandbox)
    started = time.monotonic()
    result = run(config)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60
    samples = read_lines(tmp_path / "out" / "samples.jsonl")
    metrics = read_lines(tmp_path / "out" / "metrics.jsonl")
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
        (
            "max_failed_fraction = 1.0\nmax_failed_fraction_per_step = 0.5",
            "environments failed on 12 of 12 samples in this step (100.0%), "
            "more than sandbox.max_failed_fraction_per_step = 0.5",
        ),
        (
            "max_failed_fraction = 0.25",
            "environments failed on 12 of 12 samples so far in the run (100.0%), "
            "more than sandbox.max_failed_fraction = 0.25",
        ),
    ],
)
def test_too_many_failed_episodes_end_the_run_with_the_fraction_and_the_limit(
    tmp_path: Path, limits: str, expected: str
) -> None:
    config = write_config(tmp_path, refuse="*", sandbox=f"processes = 1\n{limits}")
    result = run(config)
    assert result.returncode == 1, result.stderr
    assert expected in result.stderr
    assert "12 raised in the environment" in result.stderr
    assert "(environment `reset`): raised: ValueError: environment refused record" in result.stderr


def test_sandboxed_episodes_are_the_in_process_ones(tmp_path: Path) -> None:
    """Same seeds, same episodes: in the sandbox as in the embedded interpreter."""
    guess = 'plugin = "python_plugins.environments:GuessNumber"\noptions = { max_turns = 2 }'
    runs = {}
    for name, sandbox in [("in_process", "processes = 0"), ("sandboxed", "processes = 2")]:
        directory = tmp_path / name
        directory.mkdir()
        result = run(write_config(directory, refuse="", sandbox=sandbox, environment=guess))
        assert result.returncode == 0, result.stderr
        runs[name] = read_lines(directory / "out" / "samples.jsonl")
    fields = ("prompt", "completion", "tokens", "generated", "reward", "advantage", "failed")
    assert [[s[f] for f in fields] for s in runs["sandboxed"]] == [
        [s[f] for f in fields] for s in runs["in_process"]
    ]
    assert len(runs["sandboxed"]) == STEPS * 3 * 4
    assert {s["prompt"][:26] for s in runs["sandboxed"]} == {"i am thinking of a number "}
