"""The ProposerSolver multi-agent example and the SDK's multi-agent checker."""

from __future__ import annotations

from typing import ClassVar

import pytest

from python_plugins.multi_agent import ProposerSolver
from rollout_sdk import AgentTurn, ConfigError, JointStepResult, MultiAgentEnvironment
from rollout_sdk.testing import PluginCheckError, check_multi_agent_environment, load_plugin


def make_env(**options: object) -> ProposerSolver:
    return load_plugin("python_plugins.multi_agent:ProposerSolver", options)


def test_a_solved_problem_on_target_pays_both_agents() -> None:
    played = check_multi_agent_environment(make_env, {"answer": "7"}, ["3+4", "7"])
    (proposed, first), (answered, second) = played
    assert proposed == AgentTurn(agent="proposer", prompt="write a sum that makes 7.\nsum: ")
    assert answered == AgentTurn(agent="solver", prompt="3+4=")
    assert first.rewards == {"proposer": 1.0}
    assert second.rewards == {"solver": 1.0, "proposer": 0.25}
    assert second.next_turn is None


def test_form_alone_earns_partial_credit() -> None:
    played = check_multi_agent_environment(make_env, {"answer": "7"}, ["2+2", "5x"])
    (_, proposed), (answered, solved) = played
    # Well-formed but off target: only the form share (all 3 characters allowed).
    assert proposed.rewards == {"proposer": 0.5}
    assert answered.prompt == "2+2="
    # Wrong sum; half of the answer's characters are digits. No bonus for the proposer.
    assert solved.rewards == {"solver": 0.25}


def test_a_malformed_problem_is_shown_as_written_and_cannot_be_solved() -> None:
    env = make_env(form_weight=0.0)
    env.reset({"answer": 4}, seed=0)
    proposed = env.step(" abc ")
    assert proposed.rewards == {"proposer": 0.0}
    assert proposed.next_turn == AgentTurn(agent="solver", prompt="abc=")
    assert env.step("4").rewards == {"solver": 0.0}


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="form_weight"):
        make_env(form_weight=1.5)
    with pytest.raises(ConfigError, match="solved_bonus"):
        make_env(solved_bonus=-1.0)


def test_a_record_without_the_target_names_its_fields() -> None:
    with pytest.raises(KeyError, match="question"):
        make_env().reset({"question": "1+1="}, seed=0)


class _Broken(MultiAgentEnvironment):
    """Hands its second turn to an agent it does not declare, or rewards one."""

    agents: ClassVar[tuple[str, ...]] = ("a", "b")

    def __init__(self, config: object = None, *, reward_stranger: bool = False) -> None:
        self.reward_stranger = reward_stranger

    def reset(self, record: object, *, seed: int) -> AgentTurn:
        return AgentTurn(agent="a", prompt="go")

    def step(self, action: str) -> JointStepResult:
        if self.reward_stranger:
            return JointStepResult(rewards={"c": 1.0})
        return JointStepResult(rewards={"a": 1.0}, next_turn=AgentTurn(agent="c", prompt="x"))


def test_the_checker_rejects_turns_and_rewards_of_undeclared_agents() -> None:
    with pytest.raises(PluginCheckError, match="undeclared agent 'c'"):
        check_multi_agent_environment(_Broken, {}, ["1", "2"])
    with pytest.raises(PluginCheckError, match="reward for undeclared agent 'c'"):
        check_multi_agent_environment(lambda: _Broken(reward_stranger=True), {}, ["1"])
