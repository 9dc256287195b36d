"""ExactMatch and Format rewards."""

import pytest

from rollout_sdk import ConfigError, Sample
from rollout_sdk.testing import check_reward, load_plugin


def sample(completion: str, answer: object = "46", finish_reason: str = "stop") -> Sample:
    return Sample(
        prompt="12+34=", completion=completion, record={"answer": answer}, finish_reason=finish_reason
    )


def test_exact_match_scores_samples():
    reward = load_plugin("python_plugins.rewards:ExactMatch")
    samples = [sample("46"), sample("45"), sample("the answer is 46"), sample("no idea"), sample("")]
    assert check_reward(reward, samples) == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_exact_match_takes_the_last_or_first_candidate():
    text = "12+34 is 46, not 47"
    assert load_plugin("python_plugins.rewards:ExactMatch").score([sample(text)]) == [0.0]
    assert load_plugin("python_plugins.rewards:ExactMatch", {"position": "first"}).score([sample(text)]) == [
        0.0
    ]
    first = load_plugin("python_plugins.rewards:ExactMatch", {"position": "first"})
    assert first.score([sample("46 or 47")]) == [1.0]
    last = load_plugin("python_plugins.rewards:ExactMatch", {"position": "last"})
    assert last.score([sample("47 or 46")]) == [1.0]


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [("46.0", "46", 1.0), ("46", 46, 1.0), ("-3", "-3", 1.0), ("0.50", 0.5, 1.0), ("46.5", "46", 0.0)],
)
def test_numbers_compare_numerically(completion, answer, expected):
    assert load_plugin("python_plugins.rewards:ExactMatch").score([sample(completion, answer)]) == [expected]


def test_custom_pattern_and_answer_key_compare_as_strings():
    reward = load_plugin("python_plugins.rewards:ExactMatch", {"pattern": r"[A-D]", "answer_key": "choice"})
    samples = [
        Sample(prompt="q", completion="I pick B", record={"choice": " B "}),
        Sample(prompt="q", completion="I pick C", record={"choice": "B"}),
    ]
    assert reward.score(samples) == [1.0, 0.0]


def test_missing_answer_key_is_a_clear_error():
    reward = load_plugin("python_plugins.rewards:ExactMatch", {"answer_key": "solution"})
    with pytest.raises(KeyError, match="no `solution` field"):
        reward.score([sample("46")])


def test_invalid_pattern_is_a_config_error():
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        load_plugin("python_plugins.rewards:ExactMatch", {"pattern": "(unclosed"})


def test_format_matches_the_whole_stripped_completion():
    reward = load_plugin("python_plugins.rewards:Format", {"pattern": r"\d+"})
    samples = [sample(" 46 \n"), sample("46 apples"), sample("46", finish_reason="length")]
    assert check_reward(reward, samples) == [1.0, 0.0, 0.0]


def test_format_without_require_stop_accepts_truncated_completions():
    reward = load_plugin("python_plugins.rewards:Format", {"pattern": r"\d+", "require_stop": False})
    assert reward.score([sample("46", finish_reason="length")]) == [1.0]


def test_format_pattern_is_required():
    with pytest.raises(ConfigError, match="required"):
        load_plugin("python_plugins.rewards:Format")
