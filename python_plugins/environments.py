"""A small multi-turn example environment: guess a secret number with higher/lower hints."""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Mapping
from typing import Any

from rollout_sdk import Environment, StepResult

__all__ = ["GuessNumber"]

INTEGER = re.compile(r"-?\d+")


class GuessNumber(Environment):
    """The policy guesses a number in ``[low, high]``; each wrong guess gets "higher" or "lower".

    Reward 1.0 for a correct guess within ``max_turns``, else 0.0. The secret is
    ``record["secret"]`` when the record has one, otherwise drawn with the episode's seed.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        low: int = 1
        high: int = 20
        max_turns: int = 4

        def __post_init__(self) -> None:
            if self.low > self.high:
                raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
            if self.max_turns < 1:
                raise ValueError(f"max_turns must be at least 1, got {self.max_turns}")

    def __init__(self, config: GuessNumber.Config) -> None:
        super().__init__(config)
        self.secret: int | None = None
        self.turns = 0
        self.done = False

    def reset(self, record: Mapping[str, Any], *, seed: int) -> str:
        low, high = self.config.low, self.config.high
        if "secret" in record:
            self.secret = int(record["secret"])
            if not low <= self.secret <= high:
                raise ValueError(f"GuessNumber: secret {self.secret} is outside [{low}, {high}]")
        else:
            self.secret = random.Random(seed).randint(low, high)
        self.turns = 0
        self.done = False
        return (
            f"i am thinking of a number from {low} to {high}. "
            f"you have {self.config.max_turns} guesses. answer with one number.\nguess: "
        )

    def step(self, action: str) -> StepResult:
        if self.secret is None or self.done:
            raise RuntimeError("GuessNumber.step needs a fresh episode: call reset first")
        self.turns += 1
        out_of_turns = self.turns >= self.config.max_turns
        info = {"turns": self.turns}
        match = INTEGER.search(action)
        if match is None:
            hint = "that is not a number."
        elif int(match.group(0)) == self.secret:
            self.done = True
            return StepResult(observation="\ncorrect!\n", reward=1.0, done=True, info=info)
        else:
            hint = "higher." if self.secret > int(match.group(0)) else "lower."
        self.done = out_of_turns
        if out_of_turns:
            return StepResult(observation=f"\n{hint} no guesses left.\n", reward=0.0, done=True, info=info)
        return StepResult(observation=f"\n{hint}\nguess: ", reward=0.0, done=False, info=info)
