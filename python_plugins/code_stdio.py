"""Standard-input tests (the APPS / Codeforces style): a program, an input, the output it must
print. The expected output never enters the sandbox; the comparison is made here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Comparison", "StdioCase", "matches", "parse_cases"]

#: ``"tokens"``: the same whitespace-separated tokens; ``"lines"``: the same lines, trailing
#: whitespace and trailing blank lines aside; ``"exact"``: the same text.
Comparison = Literal["tokens", "lines", "exact"]


@dataclass(frozen=True, slots=True)
class StdioCase:
    stdin: str
    expected: str


def parse_cases(key: str, tests: Any) -> list[StdioCase]:
    """The cases of a record's tests: a list of ``{"input", "output"}``, or ``{"inputs": [...],
    "outputs": [...]}`` (APPS, CodeContests), or that as a JSON string (as APPS stores it).
    ``KeyError`` naming the key for anything else."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            raise KeyError(f"StdioTests: the record's `{key}` is a string that is not JSON") from None
    if (
        isinstance(tests, dict)
        and isinstance(tests.get("inputs"), list)
        and isinstance(tests.get("outputs"), list)
    ):
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise KeyError(f"StdioTests: the record's `{key}` has as many inputs as outputs")
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"], strict=True)]
    if not isinstance(tests, list) or not tests:
        raise KeyError(f"StdioTests: the record's `{key}` must be a non-empty list of {{input, output}}")
    cases = []
    for case in tests:
        stdin, expected = (case.get("input"), case.get("output")) if isinstance(case, dict) else (None, None)
        if isinstance(expected, list):  # CodeContests keeps each output as a list of lines
            expected = "\n".join(map(str, expected))
        if not isinstance(stdin, str) or not isinstance(expected, str):
            raise KeyError(f"StdioTests: every case of `{key}` needs an `input` and an `output` string")
        cases.append(StdioCase(stdin=stdin, expected=expected))
    return cases


def matches(printed: str, expected: str, comparison: Comparison) -> bool:
    if comparison == "exact":
        return printed == expected
    if comparison == "tokens":
        return printed.split() == expected.split()
    return _lines(printed) == _lines(expected)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines
