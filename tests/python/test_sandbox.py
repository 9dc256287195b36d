"""The sandbox worker (``python -m rollout_sdk.sandbox``) driven over its JSON-lines protocol, for
rewards and for environment episodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from rollout_sdk.sandbox import launch_spec

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
DEADLINE = 30  # seconds any one exchange may take before the test fails


class WorkerProcess:
    def __init__(self, rewards: list[dict[str, Any]], **limits: Any) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(FIXTURES)])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_sdk.sandbox"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.init = self.ask({"op": "init", "rewards": rewards, **limits})

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.readline()
        assert line, f"the worker died: {self.proc.wait(DEADLINE)}"
        return json.loads(line)

    def readline(self) -> str:
        """One line of output; a worker silent for DEADLINE seconds is killed (the line is then empty)."""
        assert self.proc.stdout is not None
        watchdog = threading.Timer(DEADLINE, self.proc.kill)
        watchdog.start()
        try:
            return self.proc.stdout.readline()
        finally:
            watchdog.cancel()

    def score(self, completion: str, call_id: int = 1) -> dict[str, Any]:
        sample = {"prompt": "p", "completion": completion, "record": {"answer": "1"}, "finish_reason": "stop"}
        return self.ask({"op": "score", "id": call_id, "sample": sample})

    def close(self) -> int:
        self.proc.kill()
        return self.proc.wait(DEADLINE)


@pytest.fixture
def worker_factory():
    started: list[WorkerProcess] = []

    def start(rewards: list[dict[str, Any]], **limits: Any) -> WorkerProcess:
        worker = WorkerProcess(rewards, **limits)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


def test_scores_with_every_reward_in_order(worker_factory) -> None:
    worker = worker_factory(
        [
            {"plugin": "python_plugins.rewards:ExactMatch", "options": {}},
            {"plugin": "sandbox_plugins:Misbehaving", "options": {"scale": 0.5}},
        ]
    )
    assert worker.init["op"] == "ready"
    assert worker.score("x = 1", call_id=4) == {"op": "scored", "id": 4, "scores": [1.0, 2.5]}


def test_scores_are_clamped_to_the_rewards_declared_range(worker_factory) -> None:
    worker = worker_factory([{"plugin": "sandbox_plugins:Bounded", "options": {}}])
    assert worker.score("12345")["scores"] == [1.0]
    assert worker.score("")["scores"] == [1.0]
    assert worker.score("-1")["scores"] == [0.0]


def test_a_raise_returns_the_traceback_and_the_worker_goes_on(worker_factory) -> None:
    worker = worker_factory([{"plugin": "sandbox_plugins:Misbehaving", "options": {}}])
    failed = worker.score("3 fails", call_id=2)
    assert failed["op"] == "failed" and failed["reason"] == "raised" and failed["id"] == 2
    assert failed["message"] == "ValueError: reward refused '3 fails' on purpose"
    assert "Traceback (most recent call last)" in failed["traceback"]
    assert "in _score" in failed["traceback"]
    assert worker.score("12", call_id=3)["scores"] == [2.0]


def test_memory_error_is_reported_as_memory(worker_factory) -> None:
    worker = worker_factory([{"plugin": "sandbox_plugins:Misbehaving", "options": {}}], memory_mb=1024)
    failed = worker.score("5")
    assert (failed["op"], failed["reason"]) == ("failed", "memory")
    assert failed["message"].startswith("MemoryError")


def test_wrong_returns_are_invalid_not_crashes(worker_factory) -> None:
    worker = worker_factory([{"plugin": "toy_plugins:NanReward", "options": {}}])
    failed = worker.score("1")
    assert (failed["reason"], failed["message"]) == ("invalid", "returned nan; rewards must be finite")
    worker = worker_factory([{"plugin": "toy_plugins:WrongCountReward", "options": {}}])
    assert worker.score("1")["message"] == "returned 0 scores for 1 sample"


def test_prints_do_not_reach_the_protocol(worker_factory) -> None:
    worker = worker_factory([{"plugin": "sandbox_plugins:Chatty", "options": {}}])
    assert worker.score("1", call_id=8) == {"op": "scored", "id": 8, "scores": [1.0]}
    assert worker.score("1", call_id=9)["id"] == 9


def test_bad_option_is_reported_with_its_key(worker_factory) -> None:
    options = {"pattern": "x", "require_stop": "yes"}
    worker = worker_factory([{"plugin": "python_plugins.rewards:Format", "options": options}])
    assert worker.init["op"] == "load_failed"
    assert worker.init["key"] == ["require_stop"]
    assert worker.init["message"] == "expected true or false, got 'yes'"


def test_unknown_plugin_is_reported_with_a_traceback(worker_factory) -> None:
    worker = worker_factory([{"plugin": "sandbox_plugins:Nope", "options": {}}])
    assert (worker.init["op"], worker.init["key"]) == ("load_failed", None)
    assert "has no attribute `Nope`" in worker.init["message"]
    assert "Traceback" in worker.init["traceback"]


def test_cpu_budget_is_per_call_and_kills_a_spinning_reward(worker_factory) -> None:
    worker = worker_factory([{"plugin": "sandbox_plugins:CpuBurner", "options": {}}], cpu_seconds=1)
    assert worker.proc.stdin is not None and worker.proc.stdout is not None
    sample = {"prompt": "p", "completion": "1", "record": {}, "finish_reason": "stop"}
    worker.proc.stdin.write(json.dumps({"op": "score", "id": 1, "sample": sample}) + "\n")
    worker.proc.stdin.flush()
    assert worker.readline() == ""
    assert worker.proc.wait(DEADLINE) == -24  # SIGXCPU, not the watchdog's SIGKILL


def test_launch_spec_names_a_python_and_this_path() -> None:
    spec = launch_spec()
    assert Path(spec["program"]).name.startswith("python")
    assert str(REPO) in spec["pythonpath"]


# Environments: the worker keeps each live episode's instance by id.

HOSTILE = {"plugin": "sandbox_environments:Hostile", "options": {}}


def reset(worker: WorkerProcess, episode: int, record: dict[str, Any], call_id: int = 1) -> dict[str, Any]:
    return worker.ask({"op": "reset", "id": call_id, "episode": episode, "record": record, "seed": 5})


def step(worker: WorkerProcess, episode: int, action: str, call_id: int = 2) -> dict[str, Any]:
    return worker.ask({"op": "step", "id": call_id, "episode": episode, "action": action})


def test_episodes_keep_their_own_state_by_id(worker_factory) -> None:
    guess = {"plugin": "python_plugins.environments:GuessNumber", "options": {"max_turns": 3}}
    worker = worker_factory([], environment=guess)
    assert worker.init["op"] == "ready"
    started = reset(worker, 2**64 - 1, {"secret": 4}, call_id=3)
    assert started["op"] == "started" and started["id"] == 3
    assert started["prompt"].startswith("i am thinking of a number from 1 to 20")
    assert reset(worker, 7, {"secret": 15})["op"] == "started"
    assert step(worker, 7, "10", call_id=4) == {
        "op": "stepped",
        "id": 4,
        "observation": "\nhigher.\nguess: ",
        "reward": 0.0,
        "done": False,
    }
    assert step(worker, 2**64 - 1, "10")["observation"] == "\nlower.\nguess: "
    correct = step(worker, 7, "15")
    assert (correct["reward"], correct["done"]) == (1.0, True)
    assert worker.ask({"op": "finish", "id": 9, "episodes": [7]}) == {"op": "finished", "id": 9}
    assert step(worker, 7, "1")["op"] == "protocol_error"
    assert step(worker, 2**64 - 1, "4")["done"] is True


def test_an_environment_that_raises_fails_the_call_and_the_worker_goes_on(worker_factory) -> None:
    worker = worker_factory([], environment=HOSTILE)
    refused = reset(worker, 1, {"prompt": "12+3=", "answer": "15"}, call_id=6)
    assert (refused["op"], refused["reason"], refused["id"], refused["reward"]) == (
        "failed",
        "raised",
        6,
        None,
    )
    assert refused["message"] == "ValueError: environment refused record '12+3=' on purpose"
    assert "in reset" in refused["traceback"]
    assert reset(worker, 2, {"prompt": "4+4=", "answer": "8"})["prompt"] == "4+4="
    raised = step(worker, 2, "31")
    assert (raised["op"], raised["reason"]) == ("failed", "raised")
    assert "in _misbehave" in raised["traceback"]
    assert reset(worker, 3, {"prompt": "7+1=", "answer": "8"})["op"] == "started"
    assert step(worker, 3, "12") == {
        "op": "stepped",
        "id": 2,
        "observation": " 7+1=",
        "reward": 0.2,
        "done": False,
    }


def test_wrong_returns_of_an_environment_are_invalid(worker_factory) -> None:
    worker = worker_factory([], environment=HOSTILE)
    for episode, action, message in [
        (1, "junk", "step returned dict; it must return a rollout_sdk.StepResult"),
        (2, "nan", "step returned reward nan; rewards must be finite"),
    ]:
        reset(worker, episode, {"prompt": "p"})
        failed = step(worker, episode, action)
        assert (failed["op"], failed["reason"], failed["message"]) == ("failed", "invalid", message)


def test_an_environment_out_of_memory_is_reported_as_memory(worker_factory) -> None:
    worker = worker_factory([], environment=HOSTILE, memory_mb=1024)
    reset(worker, 1, {"prompt": "p"})
    failed = step(worker, 1, "oom")
    assert (failed["op"], failed["reason"]) == ("failed", "memory")
    assert failed["message"].startswith("MemoryError")


def test_os_exit_in_an_environment_ends_the_worker(worker_factory) -> None:
    worker = worker_factory([], environment=HOSTILE)
    reset(worker, 1, {"prompt": "p"})
    assert worker.proc.stdin is not None
    worker.proc.stdin.write(json.dumps({"op": "step", "id": 1, "episode": 1, "action": "9"}) + "\n")
    worker.proc.stdin.flush()
    assert worker.readline() == ""
    assert worker.proc.wait(DEADLINE) == 1


def test_a_bad_environment_option_is_reported_with_its_key(worker_factory) -> None:
    guess = {"plugin": "python_plugins.environments:GuessNumber", "options": {"low": "one"}}
    worker = worker_factory([], environment=guess)
    assert (worker.init["op"], worker.init["reward"], worker.init["key"]) == ("load_failed", None, ["low"])


def test_episode_calls_need_an_environment(worker_factory) -> None:
    worker = worker_factory([{"plugin": "python_plugins.rewards:ExactMatch", "options": {}}])
    assert reset(worker, 1, {"prompt": "p"})["op"] == "protocol_error"


def test_the_seed_seeds_the_global_generators_before_the_environment_loads(worker_factory) -> None:
    draws = {"plugin": "sandbox_environments:Draws", "options": {}}
    first = reset(worker_factory([], environment=draws, seed=3), 1, {})["prompt"]
    again = reset(worker_factory([], environment=draws, seed=3), 1, {})["prompt"]
    other = reset(worker_factory([], environment=draws, seed=4), 1, {})["prompt"]
    assert first == again
    assert first.split()[0] != other.split()[0]
    assert first.split()[1] == other.split()[1]  # the episode's own seed is the same
