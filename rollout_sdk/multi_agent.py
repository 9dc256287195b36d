"""The multi-agent environment plugin: several policies taking turns in one episode.

A run with ``[agents.NAME]`` tables trains one policy per agent, each with its own optimizer
and checkpoint. The engine creates one environment instance per episode and calls ``reset``
with the data record; the environment answers whose turn it is and the full prompt that
agent sees. The engine generates that agent's turn with that agent's policy and passes the
text to ``step``, which hands out rewards (to any agents) and names the next turn, until it
returns ``next_turn=None``.

Each turn is a sample of its agent: the prompt as context, the generated tokens trained on
exactly as generated. An agent's return is the sum of the rewards it received in the
episode; every turn it took in the episode is trained with that return's advantage within
the agent's group (the ``group_size`` episodes of one record, seeded alike).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rollout_sdk.plugin import Plugin

__all__ = ["AgentTurn", "JointStepResult", "MultiAgentEnvironment"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentTurn:
    """Whose turn it is and the whole prompt that agent generates from."""

    agent: str
    prompt: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JointStepResult:
    """What the environment answers to one agent's turn.

    ``rewards`` adds to each named agent's return (any agent, not only the one that acted);
    ``next_turn`` is the next agent to act, or ``None`` when the episode is over.
    """

    rewards: Mapping[str, float] = field(default_factory=dict)
    next_turn: AgentTurn | None = None
    info: Mapping[str, Any] = field(default_factory=dict)


class MultiAgentEnvironment(Plugin):
    """Subclasses set ``agents`` to the names they hand turns to; a run's ``[agents]`` tables
    must name exactly these."""

    agents: ClassVar[tuple[str, ...]] = ()

    def reset(self, record: Mapping[str, Any], *, seed: int) -> AgentTurn:
        """Start an episode for ``record``; return the first turn."""
        raise NotImplementedError

    def step(self, action: str) -> JointStepResult:
        """Consume the text of the turn last handed out."""
        raise NotImplementedError
