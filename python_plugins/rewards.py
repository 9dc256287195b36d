"""Rule-based rewards: the answer matches the record's, the completion has the right form."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Literal

from rollout_sdk import Reward, Sample

__all__ = ["ExactMatch", "Format", "answers_equal"]


class ExactMatch(Reward):
    """1.0 when the answer extracted from the completion equals ``record[answer_key]``, else 0.0.

    Two answers that both parse as numbers compare numerically (``"46"`` equals ``"46.0"``);
    otherwise they compare as stripped strings.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        answer_key: str = "answer"
        # Regex matched against the completion; each match is a candidate answer.
        pattern: str = r"-?\d+(?:\.\d+)?"
        position: Literal["first", "last"] = "last"

        def __post_init__(self) -> None:
            _check_regex(self.pattern)

    def __init__(self, config: ExactMatch.Config) -> None:
        super().__init__(config)
        self.pattern = re.compile(config.pattern)

    def score(self, samples: Sequence[Sample]) -> list[float]:
        return [1.0 if self._is_correct(sample) else 0.0 for sample in samples]

    def _is_correct(self, sample: Sample) -> bool:
        key = self.config.answer_key
        if key not in sample.record:
            raise KeyError(
                f"ExactMatch: the record has no `{key}` field (it has: {', '.join(sample.record)})"
            )
        candidates = [match.group(0) for match in self.pattern.finditer(sample.completion)]
        if not candidates:
            return False
        extracted = candidates[0] if self.config.position == "first" else candidates[-1]
        return answers_equal(extracted, str(sample.record[key]))


def answers_equal(extracted: str, expected: str) -> bool:
    """Numeric equality when both parse as numbers, else stripped string equality."""
    try:
        return float(extracted) == float(expected)
    except ValueError:
        return extracted.strip() == expected.strip()


def _check_regex(pattern: str) -> None:
    """Raise ValueError (which the config loader reports with the option's path) for a bad regex."""
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {err}") from None


class Format(Reward):
    """1.0 when the stripped completion matches ``pattern`` in full, else 0.0.

    With ``require_stop`` a completion cut off at the length limit scores 0.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        pattern: str
        require_stop: bool = True

        def __post_init__(self) -> None:
            _check_regex(self.pattern)

    def __init__(self, config: Format.Config) -> None:
        super().__init__(config)
        self.pattern = re.compile(config.pattern)

    def score(self, samples: Sequence[Sample]) -> list[float]:
        return [1.0 if self._matches(sample) else 0.0 for sample in samples]

    def _matches(self, sample: Sample) -> bool:
        if self.config.require_stop and sample.finish_reason != "stop":
            return False
        return self.pattern.fullmatch(sample.completion.strip()) is not None
