"""Code-execution rewards: run the completion's code against the record's tests.

The completion's code never decides its own score. It runs in a fresh, bare interpreter
(``python -I -S``, standard library only) under the OS sandbox of ``rollout_sdk.isolation``
(bubblewrap by default: no network, no view of this machine's files or processes, sized tmpfs
scratch space, a cgroup memory limit where the machine has one), with limits on CPU time,
memory, file size, open files and processes, and a wall-clock timeout. The harness there
(``code_harness.py``) only answers requests over a socket the reward holds
(``code_session.py``); every verdict is computed here:

- :class:`PythonTests`: each test is an ``assert`` evaluated in this process
  (``code_checks.py``), where the completion's functions are proxies that return plain values
  (``code_proxies.py``);
- :class:`StdioTests`: the program reads each case's input and its output is compared here
  with the expected one, which never enters the sandbox (``code_stdio.py``).

A sample whose code breaks the channel, or whose harness cannot start, fails alone (a
:class:`rollout_sdk.SampleFailure`, counted in ``reward_failed``); code that crashes, times out
or runs out of memory fails the tests it had not passed. See ``docs/security.md``.
"""

from __future__ import annotations

import dataclasses
import platform
import re
import sys
from collections.abc import Sequence
from typing import Any, ClassVar

from python_plugins.code_checks import Test, UnverifiableTest, evaluate, namespace, parse_test
from python_plugins.code_proxies import proxies
from python_plugins.code_session import ChannelBroken, HarnessDidNotStart, Limits, Program, run_stdio_case
from python_plugins.code_stdio import Comparison, matches, parse_cases
from rollout_sdk import Reward, Sample, SampleFailure
from rollout_sdk.isolation import Isolation, IsolationError, find_sandbox
from rollout_sdk.seccomp import deny_filter

__all__ = ["CodeReward", "PythonTests", "StdioTests", "extract_code"]

FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block of the completion, else the whole completion."""
    blocks = FENCED.findall(completion)
    return blocks[-1] if blocks else completion


class CodeReward(Reward):
    """What the code rewards share: the sandbox, the limits, and per-sample failures."""

    score_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        tests_key: str = "tests"
        # Wall-clock seconds for the whole program (code and every test).
        timeout_seconds: float = 5.0
        cpu_seconds: int = 2
        # The program's address space; its cgroup (where there is one) allows this plus
        # scratch_mb, which covers the tmpfs /tmp and work directory (half each).
        memory_mb: int = 512
        scratch_mb: int = 64
        # The most bytes the program may write to one file.
        max_file_bytes: int = 1 << 20
        # Each value (or output) the program sends back: its encoded size and its items.
        max_value_bytes: int = 1 << 20
        max_value_items: int = 100_000
        # Calls into the completion's code per sample (each a round trip).
        max_calls: int = 10_000
        # "bubblewrap" (an OS sandbox; the run refuses to start without one) or
        # "rlimits-only" (an explicit opt-out: resource limits only, no isolation).
        isolation: Isolation = "bubblewrap"
        # "auto" (a cgroup where the machine offers one), "off", or a delegated cgroup v2
        # directory to make each program's cgroup in.
        cgroup: str = "auto"

        def __post_init__(self) -> None:
            if self.timeout_seconds <= 0 or self.cpu_seconds < 1 or self.memory_mb < 64:
                raise ValueError("timeout_seconds must be > 0, cpu_seconds >= 1 and memory_mb >= 64")
            if self.scratch_mb < 2 or self.max_file_bytes < 1 or self.max_calls < 1:
                raise ValueError("scratch_mb must be >= 2, max_file_bytes and max_calls >= 1")
            if self.max_value_bytes < 1024 or self.max_value_items < 1:
                raise ValueError("max_value_bytes must be >= 1024 and max_value_items >= 1")
            if self.isolation not in ("bubblewrap", "rlimits-only"):
                raise ValueError("isolation must be 'bubblewrap' or 'rlimits-only'")

    def __init__(self, config: CodeReward.Config) -> None:
        super().__init__(config)
        name = type(self).__name__
        try:
            self.sandbox = find_sandbox(config.isolation, cgroup=config.cgroup)
        except IsolationError as err:
            raise IsolationError(f"{name} runs completions only in a sandbox: {err}") from None
        seccomp = deny_filter()
        filtered = (
            "a seccomp filter" if seccomp else f"no seccomp filter (unknown machine {platform.machine()})"
        )
        print(f"{name}: completions run under {self.sandbox.describe()}; {filtered}", file=sys.stderr)
        self.limits = Limits(
            timeout_seconds=config.timeout_seconds,
            cpu_seconds=config.cpu_seconds,
            memory_mb=config.memory_mb,
            max_file_bytes=config.max_file_bytes,
            scratch_mb=config.scratch_mb,
            max_value_bytes=config.max_value_bytes,
            max_value_items=config.max_value_items,
            max_requests=config.max_calls,
            seccomp=seccomp,
        )

    def score(self, samples: Sequence[Sample]) -> list[float | SampleFailure]:
        return [self._score_or_fail(sample) for sample in samples]

    def _score_or_fail(self, sample: Sample) -> float | SampleFailure:
        name = type(self).__name__
        try:
            return self.score_sample(sample)
        except UnverifiableTest as err:
            return SampleFailure("invalid", f"{name}: {err}")
        except HarnessDidNotStart as err:
            return SampleFailure("crashed", f"{name}: {err}")
        except ChannelBroken as err:
            return SampleFailure(
                "crashed", f"{name}: the completion's code broke the harness's channel: {err}"
            )
        except OSError as err:  # the sandbox or its cgroup could not be set up for this sample
            return SampleFailure("crashed", f"{name}: could not start the sandbox: {err}")

    def score_sample(self, sample: Sample) -> float:
        raise NotImplementedError


class PythonTests(CodeReward):
    """The fraction of ``record[tests_key]`` that hold once the completion's code ran: each
    test one ``assert`` (``assert f(2) == 4``), or a program (HumanEval's
    ``def check(candidate): ...``, called with the record's entry point) that passes when it
    runs to its end. Code that does not run, runs out of time or memory, or crashes passes the
    tests it passed before."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CodeReward.Config):
        # The record's key naming the function(s) under test (HumanEval's `entry_point`): such
        # names are the completion's even where they shadow a built-in the tests could use.
        entry_point_key: str = "entry_point"

    def score_sample(self, sample: Sample) -> float:
        tests = _tests(self.config.tests_key, sample.record.get(self.config.tests_key))
        entry_points = _entry_points(sample.record.get(self.config.entry_point_key))
        with Program(self.sandbox, self.limits, "functions", extract_code(sample.completion)) as program:
            scope = namespace(proxies(program), entry_points)
            passed = sum(_holds(test, scope, index, program.deadline) for index, test in enumerate(tests))
        return passed / len(tests)


def _holds(test: Test, scope: dict[str, Any], index: int, deadline: float) -> bool:
    try:
        return evaluate(test, scope, deadline)
    except UnverifiableTest as err:
        raise UnverifiableTest(f"test {index} ({test.source!r:.120}) {err}") from None
    except ChannelBroken:
        raise
    except Exception:  # a wrong value, an exception in the sandbox, a program gone
        return False


def _tests(key: str, tests: Any) -> list[Test]:
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise KeyError(f"PythonTests: the record's `{key}` must be a non-empty list of test strings")
    parsed = []
    for index, test in enumerate(tests):
        try:
            parsed.append(parse_test(test))
        except UnverifiableTest as err:
            raise UnverifiableTest(
                f"test {index} ({test!r:.120}) {err}; write each test as one `assert` of an "
                "expression (e.g. `assert f(2) == 4`) or a program of plain statements"
            ) from None
    return parsed


def _entry_points(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return value
    return []


class StdioTests(CodeReward):
    """The fraction of ``record[tests_key]`` cases (an input and the output expected) whose
    output the completion's program prints, reading the input on standard input (the APPS /
    Codeforces style). A program that raises or exits non-zero fails its case."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CodeReward.Config):
        # How printed and expected output are compared: "tokens", "lines" or "exact".
        compare: Comparison = "lines"

        def __post_init__(self) -> None:
            CodeReward.Config.__post_init__(self)
            if self.compare not in ("tokens", "lines", "exact"):
                raise ValueError("compare must be 'tokens', 'lines' or 'exact'")

    def score_sample(self, sample: Sample) -> float:
        cases = parse_cases(self.config.tests_key, sample.record.get(self.config.tests_key))
        passed = 0
        with Program(self.sandbox, self.limits, "stdio", extract_code(sample.completion)) as program:
            for case in cases:
                result = run_stdio_case(program, case.stdin)
                if result is None:
                    break
                printed, outcome = result
                passed += outcome == "exited" and matches(printed, case.expected, self.config.compare)
        return passed / len(cases)
