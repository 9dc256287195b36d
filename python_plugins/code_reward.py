"""A code-execution reward: run the completion's Python against the record's tests.

Each completion runs in a fresh, bare interpreter (``python -I -S``, standard library only) in
a temporary directory, with limits on CPU time, memory (``RLIMIT_AS``), file size, open files
and processes (none may be started), a wall-clock timeout, no network, and, as root, as user
``nobody``. See ``python_plugins/code_harness.py`` for what runs inside and ``docs/reliability.md``
for what is enforced by whom. Use it with ``[sandbox] processes > 0`` so that even a failure of
the reward itself costs only its sample.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout_sdk import Reward, Sample

__all__ = ["PythonTests", "extract_code"]

HARNESS = Path(__file__).with_name("code_harness.py")
FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
DEFAULT_PRELOAD = [
    "array",
    "bisect",
    "collections",
    "copy",
    "dataclasses",
    "decimal",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "typing",
]


def extract_code(completion: str) -> str:
    """The last fenced code block of the completion, else the whole completion."""
    blocks = FENCED.findall(completion)
    return blocks[-1] if blocks else completion


class PythonTests(Reward):
    """The fraction of ``record[tests_key]`` (Python statements, e.g. ``assert f(2) == 4``)
    that pass after the completion's code ran. Code that does not run, runs out of time or
    memory, or tries what the harness forbids, passes nothing."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        tests_key: str = "tests"
        # Wall-clock seconds for the whole program (code and every test).
        timeout_seconds: float = 5.0
        cpu_seconds: int = 2
        memory_mb: int = 512
        max_file_bytes: int = 1 << 20
        # Run in a new network namespace (`unshare -n`, as root) when possible; sockets are
        # refused by the harness either way.
        isolate_network: bool = True
        # Standard-library modules imported before the code runs (it may not be able to
        # read the interpreter's library once it runs as `nobody`).
        preload: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_PRELOAD))

        def __post_init__(self) -> None:
            if self.timeout_seconds <= 0 or self.cpu_seconds < 1 or self.memory_mb < 64:
                raise ValueError("timeout_seconds must be > 0, cpu_seconds >= 1 and memory_mb >= 64")

    def __init__(self, config: PythonTests.Config) -> None:
        super().__init__(config)
        self.harness = HARNESS.read_text()
        unshare = shutil.which("unshare")
        self.prefix = [unshare, "-n"] if config.isolate_network and unshare and os.geteuid() == 0 else []

    def score(self, samples: Sequence[Sample]) -> list[float]:
        return [self._score(sample) for sample in samples]

    def _score(self, sample: Sample) -> float:
        key = self.config.tests_key
        tests = sample.record.get(key)
        if isinstance(tests, str):
            tests = [tests]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise KeyError(f"PythonTests: the record's `{key}` must be a non-empty list of test strings")
        result = self.run(extract_code(sample.completion), tests)
        return result["passed"] / len(tests) if result else 0.0

    def run(self, code: str, tests: list[str]) -> dict[str, int] | None:
        """``{"passed", "total"}``, or None when the program did not report (killed, timed out)."""
        config = self.config
        nonce = secrets.token_hex(16)
        with tempfile.TemporaryDirectory(prefix="rollout-code-") as root:
            os.chmod(root, 0o711)  # `nobody` may enter it to reach its work directory
            workdir = Path(root, "work")
            workdir.mkdir()
            payload = {
                "code": code,
                "tests": tests,
                "workdir": str(workdir),
                "nonce": nonce,
                "preload": config.preload,
                "limits": {
                    "memory_mb": config.memory_mb,
                    "cpu_seconds": config.cpu_seconds,
                    "max_file_bytes": config.max_file_bytes,
                },
            }
            output = Path(root, "output")
            with output.open("w+b") as out:
                self._execute(json.dumps(payload).encode(), out)
                out.seek(0)
                text = out.read(config.max_file_bytes).decode("utf-8", "replace")
        return _parse_result(text, nonce)

    def _execute(self, payload: bytes, out: Any) -> None:
        command = [*self.prefix, sys.executable, "-I", "-S", "-c", self.harness]
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"},
        )
        try:
            proc.communicate(payload, timeout=self.config.timeout_seconds)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the program and anything it left in its session, and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _parse_result(text: str, nonce: str) -> dict[str, int] | None:
    marker = f"RESULT {nonce} "
    for line in text.splitlines():
        if line.startswith(marker):
            result = json.loads(line[len(marker) :])
            return {"passed": int(result["passed"]), "total": int(result["total"])}
    return None
