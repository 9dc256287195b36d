"""End to end: `--trace FILE` writes a Chrome trace of the run's spans (Perfetto and
chrome://tracing open it), and `rollout launch` merges its roles' traces into the same file."""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.harness import cluster, launch, run, write_config

# Cross-process timestamps come from each process's wall clock: on one machine they agree
# to well within this (microseconds since the Unix epoch).
CLOCK_TOLERANCE_US = 50_000


@dataclass
class Slice:
    name: str
    pid: int
    track: str
    begin: float
    args: dict
    parent: Slice | None
    end: float | None = None
    children: list[Slice] = field(default_factory=list)

    def descendants(self) -> list[Slice]:
        found = []
        for child in self.children:
            found.append(child)
            found.extend(child.descendants())
        return found

    def named(self, name: str) -> list[Slice]:
        return [s for s in self.descendants() if s.name == name]


def load(path: Path) -> list[dict]:
    trace = json.loads(path.read_text())
    assert isinstance(trace, dict), "a trace object, not the raw array"
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    return events


def slices(events: list[dict]) -> list[Slice]:
    """Every span, its begin paired with its end: on each process's async track, nestable
    async events nest like a stack, children inside their parent."""
    stacks: dict[tuple[int, str], list[Slice]] = defaultdict(list)
    found = []
    for event in events:
        if event["ph"] not in ("b", "e"):
            continue
        assert event["cat"] == "rollout"
        key = (event["pid"], event["id2"]["local"])
        stack = stacks[key]
        if event["ph"] == "b":
            parent = stack[-1] if stack else None
            span = Slice(event["name"], event["pid"], key[1], event["ts"], event.get("args", {}), parent)
            if parent is not None:
                parent.children.append(span)
            stack.append(span)
            found.append(span)
        else:
            assert stack, f"an end without a begin: {event}"
            span = stack.pop()
            assert span.name == event["name"], (span.name, event)
            span.end = event["ts"]
    open_spans = [span.name for stack in stacks.values() for span in stack]
    assert not open_spans, f"spans without an end: {open_spans}"
    for span in found:
        assert span.begin <= span.end, span
        if span.parent is not None:
            assert span.parent.begin <= span.begin and span.end <= span.parent.end, (span, span.parent)
    return found


def processes(events: list[dict]) -> dict[str, int]:
    names = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert len(set(names.values())) == len(names), f"one pid per process: {names}"
    return names


def assert_wall_clock(spans: list[Slice]) -> None:
    now = time.time() * 1e6
    assert all(now - 3600e6 < s.begin <= now for s in spans), "timestamps are microseconds since the epoch"


def assert_rl_steps(spans: list[Slice], pid: int, steps: int) -> list[Slice]:
    """The controller's steps, each with its sampling (generation, scoring) and its update."""
    step_spans = [s for s in spans if s.pid == pid and s.name == "step"]
    assert [s.args["step"] for s in step_spans] == list(range(1, steps + 1))
    for step in step_spans:
        assert step.parent is None, "a step is a top-level span"
        for name in ("sample", "generate", "score", "train"):
            inside = step.named(name)
            assert inside, f"step {step.args['step']} has no {name} span"
            assert all(s.args.get("step", step.args["step"]) == step.args["step"] for s in inside)
            assert all(step.begin <= s.begin < s.end <= step.end for s in inside)
        (generate,) = step.named("generate")
        (score,) = step.named("score")
        assert generate.end <= score.begin, "scoring starts once the step's completions are in"
    return step_spans


def test_run_writes_a_chrome_trace_of_every_step(tmp_path: Path, artifacts: Path) -> None:
    trace = tmp_path / "T.json"
    result = run(write_config(tmp_path, artifacts, steps=3), "--trace", str(trace))
    assert f"trace written to {trace}" in result.stderr
    # Spans belong to the trace: log lines carry no span context.
    assert "step{" not in result.stderr and "generate{" not in result.stderr

    events = load(trace)
    names = processes(events)
    assert list(names) == ["rollout"]
    spans = slices(events)
    assert_wall_clock(spans)
    steps = assert_rl_steps(spans, names["rollout"], 3)
    for step in steps:
        # In one process the learner and the generator are the local policy; generation
        # runs in the sampling engine, one span per engine step.
        (policy_generate,) = step.named("policy.generate")
        assert policy_generate.parent.name == "generate"
        engine_steps = policy_generate.named("engine.step")
        assert engine_steps, "engine steps inside generation"
        assert all(s.args["seqs"] >= 1 and s.args["tokens"] >= 1 for s in engine_steps)
        assert [s.parent.name for s in step.named("policy.train")] == ["train"]
        assert [s.parent.name for s in step.named("rewards.score")] == ["score"]
    # Steps follow each other; a checkpoint is part of its step (every = 2), its files are
    # written in the background, and the warm start's updates have spans of their own. The
    # run's last checkpoint is written in the foreground: no write span of its own.
    assert all(a.end <= b.begin for a, b in itertools.pairwise(steps))
    assert [c.args["step"] for c in steps[1].named("checkpoint")] == [2]
    written = [s for s in spans if s.name == "checkpoint.write"]
    assert {s.args["step"] for s in written} == {0, 2} and all(s.parent is None for s in written)
    (last,) = [s for s in spans if s.name == "checkpoint" and s.args["step"] == 3]
    assert str(last.args["background"]).lower() == "false" and last.parent is None
    assert [s.args["step"] for s in spans if s.name == "sft.step"] == [1, 2]
    # One track per kind of top-level span: the steps share theirs.
    assert len({s.track for s in steps}) == 1
    assert not {s.track for s in steps} & {s.track for s in spans if s.parent is None and s.name != "step"}


def test_launch_merges_the_roles_traces_into_one(tmp_path: Path, artifacts: Path) -> None:
    trace = tmp_path / "T.json"
    config = write_config(tmp_path, artifacts, cluster(1, 1, 0), steps=2)
    result = launch(config, "--trace", str(trace))
    assert f"trace written to {trace}" in result.stderr
    # The roles' own files were merged into T.json and removed.
    assert sorted(p.name for p in tmp_path.glob("T*")) == ["T.json"]

    events = load(trace)
    names = processes(events)
    assert set(names) == {"controller", "worker-0", "trainer-0"}
    spans = slices(events)
    assert_wall_clock(spans)
    by_process = {name: [s for s in spans if s.pid == pid] for name, pid in names.items()}

    steps = assert_rl_steps(spans, names["controller"], 2)
    for step in steps:
        assert step.named("weights.publish"), "the trainer's new weights are published within the step"
    loads = [s for s in by_process["controller"] if s.name == "weights.load" and s.parent is None]
    assert len(loads) == 2

    # The worker's requests: generation (its engine steps inside) and weight swaps.
    worker = by_process["worker-0"]
    generations = [s for s in worker if s.name == "rpc.generate"]
    assert len(generations) >= 2 and all(s.parent is None for s in generations)
    for request in generations:
        assert request.named("policy.generate") and request.named("engine.step")
    swaps = [s for s in worker if s.name == "rpc.sync_weights"]
    assert swaps and all(s.named("weights.pull") and s.named("weights.import") for s in swaps)

    # The trainer's: updates, weight publishing, checkpoints.
    trainer = by_process["trainer-0"]
    updates = [s for s in trainer if s.name == "rpc.train"]
    # Two SFT steps and two RL steps.
    assert len(updates) == 4 and all(s.named("policy.train") for s in updates)
    assert any(s.name == "rpc.publish_weights" and s.named("weights.export") for s in trainer)
    assert any(s.name == "rpc.checkpoint" for s in trainer)

    # The processes' clocks line up: each RL update the trainer ran lies within the
    # controller's train span of its step.
    for step in steps:
        (train,) = step.named("train")
        low, high = train.begin - CLOCK_TOLERANCE_US, train.end + CLOCK_TOLERANCE_US
        assert any(low <= u.begin and u.end <= high for u in updates), (train, updates)
