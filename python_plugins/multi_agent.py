"""A two-agent example: a proposer writes an addition problem for a target, a solver solves it."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from rollout_sdk import AgentTurn, JointStepResult, MultiAgentEnvironment

__all__ = ["ProposerSolver"]

SUM = re.compile(r"\s*(\d{1,4})\s*\+\s*(\d{1,4})")
INTEGER = re.compile(r"-?\d+")
PROBLEM_CHARACTERS = frozenset("0123456789+")
DIGITS = frozenset("0123456789")


class ProposerSolver(MultiAgentEnvironment):
    """Self-play on addition: the proposer writes ``a+b`` for the record's target, the solver
    answers it.

    The target is ``record[target_key]`` (the quickstart data's ``answer``). Rewards:

    - proposer: ``1 - form_weight`` when its problem parses as ``a+b`` and sums to the target,
      plus ``solved_bonus`` when the solver then answers it correctly, plus ``form_weight``
      times the share of its characters that are digits or ``+``;
    - solver: ``1 - form_weight`` for the right sum of a well-formed problem, plus
      ``form_weight`` times the share of its characters that are digits.

    The form terms give a policy that cannot yet do arithmetic a gradient to start from.
    """

    agents: ClassVar[tuple[str, ...]] = ("proposer", "solver")

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        target_key: str = "answer"
        form_weight: float = 0.5
        solved_bonus: float = 0.25

        def __post_init__(self) -> None:
            if not 0.0 <= self.form_weight <= 1.0:
                raise ValueError(f"form_weight must be in [0, 1], got {self.form_weight}")
            if self.solved_bonus < 0.0:
                raise ValueError(f"solved_bonus must be >= 0, got {self.solved_bonus}")

    def __init__(self, config: ProposerSolver.Config) -> None:
        super().__init__(config)
        self.target: int | None = None
        self.problem: tuple[int, int] | None = None
        self.turn = "proposer"

    def reset(self, record: Mapping[str, Any], *, seed: int) -> AgentTurn:
        key = self.config.target_key
        if key not in record:
            raise KeyError(f"ProposerSolver: the record has no `{key}` (fields: {sorted(record)})")
        self.target = int(record[key])
        self.problem = None
        self.turn = "proposer"
        return AgentTurn(agent="proposer", prompt=f"write a sum that makes {self.target}.\nsum: ")

    def step(self, action: str) -> JointStepResult:
        if self.target is None:
            raise RuntimeError("ProposerSolver.step needs an episode: call reset first")
        if self.turn == "proposer":
            return self._proposed(action)
        return self._answered(action)

    def _proposed(self, action: str) -> JointStepResult:
        match = SUM.match(action)
        self.problem = (int(match.group(1)), int(match.group(2))) if match else None
        on_target = self.problem is not None and sum(self.problem) == self.target
        form = self.config.form_weight
        reward = form * _share(action, PROBLEM_CHARACTERS) + (1.0 - form) * on_target
        self.turn = "solver"
        shown = f"{self.problem[0]}+{self.problem[1]}" if self.problem else action.strip()
        next_turn = AgentTurn(agent="solver", prompt=f"{shown}=")
        return JointStepResult(
            rewards={"proposer": reward}, next_turn=next_turn, info={"on_target": on_target}
        )

    def _answered(self, action: str) -> JointStepResult:
        match = INTEGER.search(action)
        solved = self.problem is not None and match is not None and int(match.group(0)) == sum(self.problem)
        form = self.config.form_weight
        rewards = {"solver": form * _share(action, DIGITS) + (1.0 - form) * solved}
        if solved and self.problem is not None and sum(self.problem) == self.target:
            rewards["proposer"] = self.config.solved_bonus
        self.target = None
        return JointStepResult(rewards=rewards, next_turn=None, info={"solved": solved})


def _share(text: str, allowed: frozenset[str]) -> float:
    """The share of ``text``'s non-space characters in ``allowed`` (0 for no characters)."""
    characters = [c for c in text if not c.isspace()]
    return sum(c in allowed for c in characters) / len(characters) if characters else 0.0
