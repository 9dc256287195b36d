"""A reward sandbox worker: ``python -m rollout_sdk.sandbox``.

The ``rollout`` binary starts a pool of these processes when ``[sandbox] processes > 0`` and
talks to each over its stdin and stdout in JSON lines (never pickle). The first request loads
the configured reward plugins (the same ``load_plugin`` as in-process); every later request
scores one sample with every reward. The process applies its own limits: an address-space
limit (``RLIMIT_AS``) for its whole life and, per call, a CPU-time limit (``RLIMIT_CPU``
raised to the time used so far plus the budget, so a long-lived worker is not charged for
earlier calls). Wall-clock timeouts, crashes and restarts are the parent's business.

Requests and answers, one JSON object per line::

    {"op": "init", "rewards": [{"plugin": "m:C", "options": {...}}], "memory_mb": 0, "cpu_seconds": 0}
    -> {"op": "ready", "pid": 123}
    -> {"op": "load_failed", "reward": 0, "key": ["pattern"] | null, "message": "...", "traceback": "..."}
    {"op": "score", "id": 7, "sample": {"prompt": ..., "completion": ..., "record": {...},
                                        "finish_reason": "stop"}}
    -> {"op": "scored", "id": 7, "scores": [1.0, 0.5]}
    -> {"op": "failed", "id": 7, "reward": 1, "reason": "raised" | "memory" | "invalid",
        "message": "...", "traceback": "..."}

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
from rollout_sdk.plugin import load_plugin
from rollout_sdk.reward import Reward
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
    """The worker's state: its rewards and limits; answers one request at a time."""

    def __init__(self) -> None:
        self.rewards: list[Reward] = []
        self.cpu_seconds = 0

    def handle(self, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "init":
            return self.init(request)
        if op == "score":
            return self.score(int(request["id"]), request["sample"])
        return {"op": "protocol_error", "message": f"unknown op {op!r}"}

    def init(self, request: Mapping[str, Any]) -> dict[str, Any]:
        memory_mb = int(request.get("memory_mb", 0))
        if memory_mb > 0:
            limit = memory_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        self.cpu_seconds = int(request.get("cpu_seconds", 0))
        for index, reward in enumerate(request["rewards"]):
            try:
                self.rewards.append(load_plugin(reward["plugin"], reward.get("options") or {}, Reward))
            except ConfigError as err:
                return _load_failed(index, list(err.key), err.reason)
            except BaseException as err:
                return _load_failed(index, None, _one_line(err), traceback.format_exc())
        return {"op": "ready", "pid": os.getpid()}

    def score(self, call_id: int, fields: Mapping[str, Any]) -> dict[str, Any]:
        sample = Sample(
            prompt=fields["prompt"],
            completion=fields["completion"],
            record=fields.get("record") or {},
            finish_reason=fields.get("finish_reason", "stop"),
        )
        self._limit_cpu()
        scores: list[float] = []
        for index, reward in enumerate(self.rewards):
            try:
                result = reward.score([sample])
            except MemoryError as err:
                return _failed(call_id, index, "memory", _one_line(err), traceback.format_exc())
            except BaseException as err:
                return _failed(call_id, index, "raised", _one_line(err), traceback.format_exc())
            score = _single_finite(result)
            if isinstance(score, str):
                return _failed(call_id, index, "invalid", score)
            scores.append(score)
        return {"op": "scored", "id": call_id, "scores": scores}

    def _limit_cpu(self) -> None:
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


def _one_line(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _load_failed(index: int, key: list[str] | None, message: str, trace: str = "") -> dict[str, Any]:
    return {"op": "load_failed", "reward": index, "key": key, "message": message, "traceback": trace}


def _failed(call_id: int, index: int, reason: str, message: str, trace: str = "") -> dict[str, Any]:
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
