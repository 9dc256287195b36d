"""The environment plugin: multi-turn interaction, Gymnasium-style.

The engine creates one instance per episode (so instances may keep per-episode state),
calls ``reset`` with the data record, then alternates: the policy generates a turn, the
engine calls ``step`` with its text, and appends the returned observation to the context.
The tokens the policy generated are trained on exactly as generated; observation tokens are
context only. A single-turn prompt/answer task is an environment whose first ``step`` is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_sdk.plugin import Plugin

__all__ = ["Environment", "StepResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What the environment answers to one policy turn.

    ``observation`` is appended to the context before the next turn (ignored when ``done``);
    ``reward`` adds to the episode's return.
    """

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)


class Environment(Plugin):
    def reset(self, record: Mapping[str, Any], *, seed: int) -> str:
        """Start an episode for ``record``; return the first prompt text."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """Consume the policy's turn ``action``."""
        raise NotImplementedError
