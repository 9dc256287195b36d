"""A sandbox worker: ``python -m rollout_sdk.sandbox``.

The ``rollout`` binary starts pools of these processes when ``[sandbox] processes > 0`` and
talks to each over its stdin and stdout in JSON lines (never pickle). The first request loads
the configured reward plugins, or the environment plugin (the same ``load_plugin`` as
in-process); every later request scores one sample with every reward, or makes one call of
one episode (the worker keeps each live episode's environment instance by its id). The
process applies its own limits: an address-space limit (``RLIMIT_AS``) for its whole life
and, per call, a CPU-time limit (``RLIMIT_CPU`` raised to the time used so far plus the
budget, so a long-lived worker is not charged for earlier calls). Wall-clock timeouts,
crashes and restarts are the parent's business.

Requests and answers, one JSON object per line::

    {"op": "init", "rewards": [{"plugin": "m:C", "options": {...}}], "memory_mb": 0, "cpu_seconds": 0}
    -> {"op": "ready", "pid": 123}
    -> {"op": "load_failed", "reward": 0, "key": ["pattern"] | null, "message": "...", "traceback": "..."}
    {"op": "score", "id": 7, "sample": {"prompt": ..., "completion": ..., "record": {...},
                                        "finish_reason": "stop"}}
    -> {"op": "scored", "id": 7, "scores": [1.0, 0.5]}
    -> {"op": "failed", "id": 7, "reward": 1, "reason": "raised" | "memory" | "invalid"
        (or a SampleFailure's "crashed" | "timeout"),
        "message": "...", "traceback": "..."}

An environment worker (``"reward": null`` in its ``load_failed`` and ``failed`` answers)::

    {"op": "init", "rewards": [], "environment": {"plugin": "m:C", "options": {...}},
     "seed": 3, "memory_mb": 0, "cpu_seconds": 0}
    {"op": "reset", "id": 8, "episode": 41, "record": {...}, "seed": 5}
    -> {"op": "started", "id": 8, "prompt": "..."}
    {"op": "step", "id": 9, "episode": 41, "action": "..."}
    -> {"op": "stepped", "id": 9, "observation": "...", "reward": 0.0, "done": false}
    {"op": "finish", "id": 10, "episodes": [41]}
    -> {"op": "finished", "id": 10}

Anything a plugin prints goes to stderr: the protocol has the original stdout to itself.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import shutil
import signal
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any

from rollout_sdk.config import ConfigError
from rollout_sdk.environment import Environment
from rollout_sdk.plugin import load_plugin
from rollout_sdk.reward import Reward, SampleFailure, check_score_range
from rollout_sdk.seeding import seed_everything
from rollout_sdk.types import Sample

__all__ = ["Worker", "launch_spec", "main"]

_PR_SET_PDEATHSIG = 1


def launch_spec() -> dict[str, Any]:
    """How the host starts a worker: this interpreter's executable and ``sys.path``.

    Called in the embedded interpreter, whose ``sys.executable`` may be the ``rollout`` binary
    when no virtual environment is in use; then a ``pythonX.Y`` on ``PATH`` is used.
    """
    candidates = [sys.executable, getattr(sys, "_base_executable", "")]
    program = next((c for c in candidates if c and os.path.basename(c).startswith("python")), None)
    if program is None:
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        program = shutil.which(version) or shutil.which("python3") or version
    paths = [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)]
    return {"program": program, "pythonpath": paths}


class Worker:
    """The worker's state: its rewards or environment, live episodes and limits; answers one
    request at a time."""

    def __init__(self) -> None:
        self.rewards: list[Reward] = []
        self.ranges: list[tuple[float, float]] = []
        self.environment: Environment | None = None
        self.episodes: dict[int, Environment] = {}
        self.cpu_seconds = 0

    def handle(self, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "init":
            return self.init(request)
        if op == "score":
            return self.score(int(request["id"]), request["sample"])
        if op in ("reset", "step", "finish") and self.environment is None:
            return {"op": "protocol_error", "message": f"{op!r} needs an environment"}
        if op == "reset":
            return self.reset(
                int(request["id"]), int(request["episode"]), request["record"], int(request["seed"])
            )
        if op == "step":
            return self.step(int(request["id"]), int(request["episode"]), str(request["action"]))
        if op == "finish":
            for episode in request["episodes"]:
                self.episodes.pop(int(episode), None)
            return {"op": "finished", "id": int(request["id"])}
        return {"op": "protocol_error", "message": f"unknown op {op!r}"}

    def init(self, request: Mapping[str, Any]) -> dict[str, Any]:
        memory_mb = int(request.get("memory_mb", 0))
        if memory_mb > 0:
            limit = memory_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        self.cpu_seconds = int(request.get("cpu_seconds", 0))
        if request.get("seed") is not None:
            seed_everything(int(request["seed"]))
        for index, reward in enumerate(request["rewards"]):
            try:
                loaded = load_plugin(reward["plugin"], reward.get("options") or {}, Reward)
                self.ranges.append(check_score_range(loaded))
                self.rewards.append(loaded)
            except ConfigError as err:
                return _load_failed(index, list(err.key), err.reason)
            except BaseException as err:
                return _load_failed(index, None, _one_line(err), traceback.format_exc())
        spec = request.get("environment")
        if spec:
            try:
                self.environment = load_plugin(spec["plugin"], spec.get("options") or {}, Environment)
            except ConfigError as err:
                return _load_failed(None, list(err.key), err.reason)
            except BaseException as err:
                return _load_failed(None, None, _one_line(err), traceback.format_exc())
        return {"op": "ready", "pid": os.getpid()}

    def score(self, call_id: int, fields: Mapping[str, Any]) -> dict[str, Any]:
        # The engine's `ScoreSample`, whose fields are `Sample`'s (a contract test holds them).
        sample = Sample(**fields)
        self.limit_cpu()
        scores: list[float] = []
        for index, reward in enumerate(self.rewards):
            try:
                result = reward.score([sample])
            except MemoryError as err:
                return _failed(call_id, index, "memory", _one_line(err), traceback.format_exc())
            except BaseException as err:
                return _failed(call_id, index, "raised", _one_line(err), traceback.format_exc())
            if _is_failure(result):
                failure = result[0]
                return _failed(call_id, index, failure.reason, failure.message)
            score = _single_finite(result)
            if isinstance(score, str):
                return _failed(call_id, index, "invalid", score)
            low, high = self.ranges[index]
            scores.append(min(max(score, low), high))
        return {"op": "scored", "id": call_id, "scores": scores}

    def reset(self, call_id: int, episode: int, record: Mapping[str, Any], seed: int) -> dict[str, Any]:
        """A fresh instance of the environment's class (with its ``Config``) for ``episode``."""
        prototype = self.environment
        assert prototype is not None
        self.limit_cpu()
        try:
            instance = type(prototype)(prototype.config)
            prompt = instance.reset(record, seed=seed)
        except MemoryError as err:
            return _failed(call_id, None, "memory", _one_line(err), traceback.format_exc())
        except BaseException as err:
            return _failed(call_id, None, "raised", _one_line(err), traceback.format_exc())
        if not isinstance(prompt, str):
            message = f"reset returned {type(prompt).__name__}; it must return the first prompt as a str"
            return _failed(call_id, None, "invalid", message)
        self.episodes[episode] = instance
        return {"op": "started", "id": call_id, "prompt": prompt}

    def step(self, call_id: int, episode: int, action: str) -> dict[str, Any]:
        instance = self.episodes.get(episode)
        if instance is None:
            return {"op": "protocol_error", "message": f"episode {episode} is not running here"}
        self.limit_cpu()
        try:
            outcome = _step_outcome(instance.step(action))
        except MemoryError as err:
            return _failed(call_id, None, "memory", _one_line(err), traceback.format_exc())
        except BaseException as err:
            return _failed(call_id, None, "raised", _one_line(err), traceback.format_exc())
        if isinstance(outcome, str):
            return _failed(call_id, None, "invalid", outcome)
        return {"op": "stepped", "id": call_id, **outcome}

    def limit_cpu(self) -> None:
        """This call may use ``cpu_seconds`` more than the process has used so far."""
        if self.cpu_seconds <= 0:
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        used = math.ceil(usage.ru_utime + usage.ru_stime)
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = used + self.cpu_seconds
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _is_failure(result: Any) -> bool:
    """Whether the reward returned one :class:`SampleFailure` for its one sample."""
    return isinstance(result, Sequence) and len(result) == 1 and isinstance(result[0], SampleFailure)


def _single_finite(result: Any) -> float | str:
    """The one finite score in ``result``, or why it is not one."""
    if not isinstance(result, Sequence) or isinstance(result, str | bytes):
        return f"returned {type(result).__name__}; rewards return a sequence of float"
    if len(result) != 1:
        return f"returned {len(result)} scores for 1 sample"
    try:
        score = float(result[0])
    except (TypeError, ValueError):
        return f"returned {type(result[0]).__name__}, not a float"
    if not math.isfinite(score):
        return f"returned {score}; rewards must be finite"
    return score


def _step_outcome(result: Any) -> dict[str, Any] | str:
    """``step``'s answer as the protocol's fields, or why it is not a ``StepResult``."""
    try:
        observation, reward, done = result.observation, result.reward, result.done
    except AttributeError:
        return f"step returned {type(result).__name__}; it must return a rollout_sdk.StepResult"
    if not isinstance(observation, str):
        return f"step returned an observation of type {type(observation).__name__}, not str"
    if isinstance(reward, str | bytes) or not hasattr(reward, "__float__"):
        return f"step returned a reward of type {type(reward).__name__}, not a float"
    reward = float(reward)
    if not math.isfinite(reward):
        return f"step returned reward {reward}; rewards must be finite"
    if type(done).__name__ not in ("bool", "bool_"):
        return f"step returned done of type {type(done).__name__}, not bool"
    return {"observation": observation, "reward": reward, "done": bool(done)}


def _one_line(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _load_failed(index: int | None, key: list[str] | None, message: str, trace: str = "") -> dict[str, Any]:
    return {"op": "load_failed", "reward": index, "key": key, "message": message, "traceback": trace}


def _failed(call_id: int, index: int | None, reason: str, message: str, trace: str = "") -> dict[str, Any]:
    return {
        "op": "failed",
        "id": call_id,
        "reward": index,
        "reason": reason,
        "message": message,
        "traceback": trace,
    }


def _take_stdout() -> IO[str]:
    """The protocol channel: a private copy of stdout; fd 1 (and ``print``) now go to stderr."""
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return channel


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the ``rollout`` that started it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the closed stdin still ends the loop


def main() -> int:
    channel = _take_stdout()
    _die_with_parent()
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        answer = worker.handle(json.loads(line))
        channel.write(json.dumps(answer, allow_nan=False) + "\n")
        channel.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
