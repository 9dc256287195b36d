"""A code-execution reward: run the completion's Python against the record's tests.

The completion's code never decides its own score. Each test is an ``assert`` split in two
(``python_plugins/code_checks.py``): the expressions to evaluate (``add(1, 2)``), sent to the
code's sandbox, and the expected values with the comparison, kept here. The code runs in a
fresh, bare interpreter (``python -I -S``, standard library only) under the OS sandbox of
``rollout_sdk.isolation`` (bubblewrap by default: no network, no view of this machine's files
or processes, an empty work directory), with limits on CPU time, memory, file size, open files
and processes, and a wall-clock timeout; the harness (``python_plugins/code_harness.py``) only
reports the expressions' values as plain data, which are compared here. See
``docs/security.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from python_plugins.code_checks import Check, UnverifiableTest, decode, parse_test
from rollout_sdk import Reward, Sample
from rollout_sdk.isolation import Isolation, IsolationError, find_sandbox, interpreter

__all__ = ["HarnessFailure", "PythonTests", "extract_code"]

HARNESS = Path(__file__).with_name("code_harness.py")
FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


class HarnessFailure(RuntimeError):
    """The sandboxed harness did not start: the sample fails, it does not score 0."""


def extract_code(completion: str) -> str:
    """The last fenced code block of the completion, else the whole completion."""
    blocks = FENCED.findall(completion)
    return blocks[-1] if blocks else completion


class PythonTests(Reward):
    """The fraction of ``record[tests_key]`` (``assert`` statements, e.g. ``assert f(2) == 4``)
    that pass after the completion's code ran. Code that does not run, runs out of time or
    memory, or crashes passes what it passed before."""

    score_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        tests_key: str = "tests"
        # Wall-clock seconds for the whole program (code and every test).
        timeout_seconds: float = 5.0
        cpu_seconds: int = 2
        memory_mb: int = 512
        # The most bytes the program may write to a file, its report included.
        max_file_bytes: int = 1 << 20
        # "bubblewrap" (an OS sandbox; the run refuses to start without one) or
        # "rlimits-only" (an explicit opt-out: resource limits only, no isolation).
        isolation: Isolation = "bubblewrap"

        def __post_init__(self) -> None:
            if self.timeout_seconds <= 0 or self.cpu_seconds < 1 or self.memory_mb < 64:
                raise ValueError("timeout_seconds must be > 0, cpu_seconds >= 1 and memory_mb >= 64")
            if self.isolation not in ("bubblewrap", "rlimits-only"):
                raise ValueError("isolation must be 'bubblewrap' or 'rlimits-only'")

    def __init__(self, config: PythonTests.Config) -> None:
        super().__init__(config)
        try:
            self.sandbox = find_sandbox(config.isolation)
        except IsolationError as err:
            raise IsolationError(f"PythonTests runs completions only in a sandbox: {err}") from None
        print(f"PythonTests: completions run under {self.sandbox.describe()}", file=sys.stderr)
        self.harness = HARNESS.read_text()

    def score(self, samples: Sequence[Sample]) -> list[float]:
        return [self._score(sample) for sample in samples]

    def _score(self, sample: Sample) -> float:
        checks = _checks(self.config.tests_key, sample.record.get(self.config.tests_key))
        probes = [probe for check in checks for probe in check.probes]
        values = self.run(extract_code(sample.completion), probes)
        passed, start = 0, 0
        for check in checks:
            end = start + len(check.probes)
            mine = values[start:end]
            start = end
            if len(mine) == len(check.probes) and all(v is not _FAILED for v in mine):
                try:
                    passed += check.passed(mine)
                except Exception:  # comparing values the code returned: only its test fails
                    continue
        return passed / len(checks)

    def run(self, code: str, probes: list[str]) -> list[Any]:
        """Each probe's value, or ``_FAILED`` where it raised, returned something that is not
        plain data, or never ran (the code exited or was killed before it)."""
        config = self.config
        payload = {
            "code": code,
            "probes": probes,
            "limits": {
                "memory_mb": config.memory_mb,
                "cpu_seconds": config.cpu_seconds,
                "max_file_bytes": config.max_file_bytes,
            },
        }
        with tempfile.TemporaryDirectory(prefix="rollout-code-") as root:
            os.chmod(root, 0o711)  # the sandbox may run as `nobody`: it must reach its directory
            workdir = Path(root, "work")
            workdir.mkdir()
            report, errors = Path(root, "report"), Path(root, "errors")
            with report.open("w+b") as out, errors.open("w+b") as err:
                self._execute(json.dumps(payload).encode(), workdir, out, err)
                out.seek(0)
                lines = out.read(config.max_file_bytes).decode("utf-8", "replace").splitlines()
                if not lines or lines[0] != "started":
                    err.seek(0)
                    why = err.read(2000).decode("utf-8", "replace").strip() or "no report"
                    raise HarnessFailure(f"the sandboxed harness did not start: {why}")
        values = [_value(line) for line in lines[1 : 1 + len(probes)]]
        return values + [_FAILED] * (len(probes) - len(values))

    def _execute(self, payload: bytes, workdir: Path, out: Any, err: Any) -> None:
        argv = [interpreter(), "-I", "-S", "-c", self.harness]
        proc = self.sandbox.popen(argv, workdir, stdin=subprocess.PIPE, stdout=out, stderr=err)
        try:
            proc.communicate(payload, timeout=self.config.timeout_seconds)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _kill_group(proc)


_FAILED = object()


def _value(line: str) -> Any:
    try:
        status, data = json.loads(line)
        return decode(data) if status == "ok" else _FAILED
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError):
        return _FAILED


@lru_cache(maxsize=4096)
def _parse(test: str) -> Check:
    return parse_test(test)


def _checks(key: str, tests: Any) -> list[Check]:
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise KeyError(f"PythonTests: the record's `{key}` must be a non-empty list of test strings")
    checks = []
    for index, test in enumerate(tests):
        try:
            checks.append(_parse(test))
        except UnverifiableTest as err:
            raise UnverifiableTest(
                f"PythonTests: test {index} ({test!r:.120}) {err}; write each test as one `assert` "
                "comparing expressions with literals (e.g. `assert f(2) == 4`), or asserting one "
                "expression true or false, so its verdict is computed outside the sandbox"
            ) from None
    return checks


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the program (bubblewrap takes the sandbox with it) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
