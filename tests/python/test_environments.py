"""The GuessNumber multi-turn example."""

import pytest

from python_plugins.environments import GuessNumber
from rollout_sdk import ConfigError
from rollout_sdk.testing import check_environment, load_plugin


def make_env(**options) -> GuessNumber:
    return load_plugin("python_plugins.environments:GuessNumber", options)


def test_check_environment_with_a_given_secret():
    results = check_environment(make_env, {"secret": 7}, ["10", "5", "7", "8"])
    assert [r.observation.split()[0] for r in results] == ["lower.", "higher.", "correct!"]
    assert [r.reward for r in results] == [0.0, 0.0, 1.0]
    assert [r.done for r in results] == [False, False, True]


def test_secret_comes_from_the_seed_without_a_record_secret():
    secrets = set()
    for seed in range(20):
        env = make_env(low=1, high=5, max_turns=5)
        env.reset({}, seed=seed)
        for guess in range(1, 6):
            if env.step(str(guess)).reward == 1.0:
                secrets.add(guess)
                break
    assert len(secrets) > 1
    check_environment(make_env, {}, ["1", "2", "3"], seed=3)


def test_prompt_names_the_range():
    prompt = make_env(low=3, high=9).reset({}, seed=0)
    assert "3" in prompt
    assert "9" in prompt


def test_non_numbers_get_a_hint_and_use_a_turn():
    env = make_env(max_turns=2)
    env.reset({"secret": 4}, seed=0)
    first = env.step("maybe four?")
    assert "not a number" in first.observation
    assert not first.done
    assert env.step("the answer is 4").reward == 1.0


def test_episode_ends_after_max_turns_without_reward():
    env = make_env(max_turns=2)
    env.reset({"secret": 4}, seed=0)
    assert not env.step("1").done
    last = env.step("2")
    assert last.done
    assert last.reward == 0.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step("4")


def test_secret_outside_the_range_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        make_env(high=10).reset({"secret": 11}, seed=0)


@pytest.mark.parametrize("options", [{"low": 5, "high": 1}, {"max_turns": 0}])
def test_config_is_validated(options):
    with pytest.raises(ConfigError):
        make_env(**options)
