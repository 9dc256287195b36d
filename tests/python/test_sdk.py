"""The rollout_sdk contract itself: strict configs, plugin loading, pipelines and objectives."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import numpy as np
import pytest
import torch

from rollout_sdk import (
    ConfigError,
    DpoObjective,
    GrpoObjective,
    GspoObjective,
    Pipeline,
    PluginSpecError,
    PpoObjective,
    Reward,
    SftObjective,
    TrainBatch,
    Transform,
    build_config,
    load_plugin,
    resolve_plugin_class,
)
from rollout_sdk.objectives import objective_loss, token_logprobs


@dataclasses.dataclass(kw_only=True, slots=True)
class Inner:
    size: int = 1


@dataclasses.dataclass(kw_only=True, slots=True)
class Options:
    name: str
    rate: float = 0.1
    count: int = 0
    flag: bool = False
    mode: Literal["fast", "slow"] = "fast"
    maybe: int | None = None
    items: list[int] = dataclasses.field(default_factory=list)
    pair: tuple[float, float] = (0.0, 1.0)
    inner: Inner = dataclasses.field(default_factory=Inner)

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError("count must not be negative")


def config_error(options: dict) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        build_config(Options, options)
    return caught.value


# build_config


def test_build_config_fills_defaults_and_converts_types():
    config = build_config(Options, {"name": "x", "rate": 1, "items": [1, 2], "pair": [0.5, 2]})
    assert config == Options(name="x", rate=1.0, items=[1, 2], pair=(0.5, 2.0))
    assert type(config.rate) is float
    assert type(config.pair) is tuple
    assert config.pair == (0.5, 2.0)


def test_fixed_length_tuple_checks_length_and_each_type():
    assert "expected 2 values, got 3" in str(config_error({"name": "x", "pair": [1, 2, 3]}))
    err = config_error({"name": "x", "pair": [1, "two"]})
    assert err.key == ("pair", "1")


def test_unknown_key_suggests_the_closest_option():
    err = config_error({"name": "x", "rat": 0.5})
    assert err.key == ("rat",)
    assert "did you mean `rate`" in str(err)
    assert "known options" in str(err)


def test_missing_required_option():
    err = config_error({})
    assert err.key == ("name",)
    assert "required" in str(err)


@pytest.mark.parametrize(
    ("options", "key", "reason"),
    [
        ({"rate": "fast"}, ("rate",), "expected a number"),
        ({"rate": True}, ("rate",), "expected a number"),
        ({"count": 1.5}, ("count",), "expected an integer"),
        ({"count": True}, ("count",), "expected an integer"),
        ({"flag": 1}, ("flag",), "expected true or false"),
        ({"name": 3}, ("name",), "expected a string"),
        ({"items": "1,2"}, ("items",), "expected an array"),
        ({"items": [1, "2"]}, ("items", "1"), "expected an integer"),
    ],
)
def test_wrong_types_name_the_option(options, key, reason):
    err = config_error({"name": "x", **options})
    assert err.key == key
    assert reason in str(err)


def test_literal_accepts_listed_values_only():
    assert build_config(Options, {"name": "x", "mode": "slow"}).mode == "slow"
    err = config_error({"name": "x", "mode": "medium"})
    assert err.key == ("mode",)
    assert "'fast'" in str(err)


def test_optional_accepts_none_or_the_type():
    assert build_config(Options, {"name": "x", "maybe": None}).maybe is None
    assert build_config(Options, {"name": "x", "maybe": 3}).maybe == 3
    assert config_error({"name": "x", "maybe": "3"}).key == ("maybe",)


def test_nested_dataclass_is_built_strictly():
    assert build_config(Options, {"name": "x", "inner": {"size": 3}}).inner == Inner(size=3)
    err = config_error({"name": "x", "inner": {"sise": 3}})
    assert err.key == ("inner", "sise")
    assert "did you mean `size`" in str(err)


def test_validation_errors_of_the_dataclass_become_config_errors():
    err = config_error({"name": "x", "count": -1})
    assert "count must not be negative" in str(err)


def test_options_must_be_a_table():
    with pytest.raises(ConfigError, match="expected a table"):
        build_config(Options, ["name"])


# load_plugin


def test_load_plugin_builds_the_config():
    reward = load_plugin("python_plugins.rewards:ExactMatch", {"position": "first"}, Reward)
    assert reward.config.position == "first"


@pytest.mark.parametrize("spec", ["python_plugins.rewards", "python_plugins.rewards:", ":ExactMatch"])
def test_malformed_spec(spec):
    with pytest.raises(PluginSpecError, match=r"package\.module:ClassName"):
        resolve_plugin_class(spec)


def test_missing_module():
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        resolve_plugin_class("no_such_module:Thing")


def test_missing_attribute():
    with pytest.raises(PluginSpecError, match="has no attribute `Nope`"):
        resolve_plugin_class("python_plugins.rewards:Nope")


@pytest.mark.parametrize("spec", ["collections:OrderedDict", "python_plugins.data:JsonlPrompts"])
def test_class_of_the_wrong_kind(spec):
    with pytest.raises(PluginSpecError, match=r"is not a subclass of rollout_sdk\.Reward"):
        resolve_plugin_class(spec, Reward)


def test_load_plugin_rejects_bad_options():
    with pytest.raises(ConfigError, match="position"):
        load_plugin("python_plugins.rewards:ExactMatch", {"position": "middle"})


# Pipeline


class DropOdd(Transform):
    def __call__(self, record):
        return None if record["n"] % 2 else record


class Recorder(Transform):
    def __init__(self, config=None):
        super().__init__(config)
        self.seen = []

    def __call__(self, record):
        self.seen.append(record["n"])
        return {**record, "prompt": str(record["n"])}


def test_pipeline_drops_records_before_later_transforms():
    recorder = Recorder()
    out = list(Pipeline([DropOdd(None), recorder])({"n": n} for n in range(5)))
    assert out == [{"n": 0, "prompt": "0"}, {"n": 2, "prompt": "2"}, {"n": 4, "prompt": "4"}]
    assert recorder.seen == [0, 2, 4]


# objective_loss


def train_batch(objective, *, logprob_mask, advantages=None, old=None, loss_scale=1.0):
    mask = np.asarray([logprob_mask], dtype=np.float32)
    zeros = np.zeros_like(mask)
    return TrainBatch(
        input_ids=np.zeros(mask.shape, dtype=np.int64),
        attention_mask=np.ones(mask.shape, dtype=np.int64),
        loss_mask=mask,
        advantages=zeros if advantages is None else np.asarray([advantages], dtype=np.float32),
        old_logprobs=zeros if old is None else np.asarray([old], dtype=np.float32),
        loss_scale=loss_scale,
        objective=objective,
    )


def test_grpo_clips_the_ratio_on_both_sides():
    # Ratios 1.5 (A=+1) and 0.5 (A=-1) are clipped to [0.9, 1.3]; 1.1 (A=+1) and 0.95 (A=-1) are not.
    ratios = [1.5, 0.5, 1.1, 0.95]
    logprobs = torch.tensor([[0.0, *[math.log(r) for r in ratios]]])
    batch = train_batch(
        GrpoObjective(clip_low=0.1, clip_high=0.3),
        logprob_mask=[0, 1, 1, 1, 1],
        advantages=[0, 1, -1, 1, -1],
        loss_scale=0.5,
    )
    out = objective_loss(logprobs, batch)
    # Per token: -min(r*A, clip(r)*A) = -1.3, +0.9, -1.1, +0.95.
    expected_sum = -1.3 + 0.9 - 1.1 + 0.95
    assert out.loss.item() == pytest.approx(0.5 * expected_sum, abs=1e-6)
    assert out.metrics["loss"] == pytest.approx(expected_sum / 4, abs=1e-6)
    assert out.metrics["clip_fraction"] == pytest.approx(0.5)
    assert out.metrics["ratio_mean"] == pytest.approx(sum(ratios) / 4, abs=1e-6)


def test_grpo_gradient_vanishes_where_clipped():
    logprobs = torch.tensor([[0.0, math.log(1.5), math.log(1.1)]], requires_grad=True)
    batch = train_batch(GrpoObjective(), logprob_mask=[0, 1, 1], advantages=[0, 1, 1])
    objective_loss(logprobs, batch).loss.backward()
    assert logprobs.grad[0, 1].item() == 0.0
    assert logprobs.grad[0, 2].item() == pytest.approx(-1.1, abs=1e-6)


def test_masked_tokens_do_not_count():
    logprobs = torch.tensor([[0.0, -1.0, 5.0]])
    batch = train_batch(GrpoObjective(), logprob_mask=[0, 1, 0], advantages=[0, 2, 7], old=[0, -1, 0])
    out = objective_loss(logprobs, batch)
    assert out.loss.item() == pytest.approx(-2.0)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)


def test_kl_uses_the_k3_estimator():
    logprobs = torch.tensor([[0.0, -1.0, -2.0]])
    reference = torch.tensor([[0.0, -0.5, -2.5]])
    batch = train_batch(GrpoObjective(kl_coef=0.1), logprob_mask=[0, 1, 1], old=[0, -1, -2])
    out = objective_loss(logprobs, batch, ref_logprobs=reference)
    k3 = [math.exp(d) - d - 1 for d in (0.5, -0.5)]
    assert out.metrics["kl"] == pytest.approx(sum(k3) / 2, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * sum(k3), abs=1e-6)


def test_kl_needs_reference_logprobs():
    batch = train_batch(GrpoObjective(kl_coef=0.1), logprob_mask=[0, 1])
    with pytest.raises(ValueError, match="reference"):
        objective_loss(torch.zeros(1, 2), batch)


def test_sft_is_the_masked_negative_log_likelihood():
    logprobs = torch.tensor([[0.0, -1.0, -2.0, -3.0]], requires_grad=True)
    batch = train_batch(SftObjective(), logprob_mask=[0, 1, 1, 0], loss_scale=0.25)
    out = objective_loss(logprobs, batch)
    assert out.metrics["nll"] == pytest.approx(1.5)
    assert out.metrics["loss"] == pytest.approx(1.5)
    assert out.loss.item() == pytest.approx(0.75)
    out.loss.backward()
    assert logprobs.grad.tolist() == [[0.0, -0.25, -0.25, 0.0]]


def test_unknown_objective_is_rejected():
    batch = train_batch(SftObjective(), logprob_mask=[0, 1])
    batch = dataclasses.replace(batch, objective="a2c")
    with pytest.raises(TypeError, match="unknown objective"):
        objective_loss(torch.zeros(1, 2), batch)


def test_gspo_clips_the_sequence_ratio_not_each_token():
    # Token ratios 2.0 and 0.5: their geometric mean is 1, inside any clip range, so nothing
    # is clipped although each token's ratio is far outside [1 - 3e-4, 1 + 4e-4].
    logprobs = torch.tensor([[0.0, math.log(2.0), math.log(0.5)]], requires_grad=True)
    batch = train_batch(GspoObjective(), logprob_mask=[0, 1, 1], advantages=[0, 1, 1])
    out = objective_loss(logprobs, batch)
    assert out.metrics["clip_fraction"] == 0.0
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)
    out.loss.backward()
    # d/dlogp_t of -exp(mean log ratio) * A summed over 2 tokens: each token gets -2 * 1/2.
    assert logprobs.grad[0, 1:].tolist() == pytest.approx([-1.0, -1.0])
    shifted = torch.tensor([[0.0, math.log(1.1), math.log(1.1)]])
    assert objective_loss(shifted, batch).metrics["clip_fraction"] == 1.0


def test_kl_in_the_reward_is_summed_to_the_end_of_the_sequence():
    # REINFORCE++: k1 = old - ref per token, subtracted from every earlier token's return.
    old = [0.0, -1.0, -1.0, -1.0]
    reference = torch.tensor([[0.0, -1.5, -1.0, -2.0]])
    batch = train_batch(
        GrpoObjective(kl_coef=0.1, kl_penalty="reward"),
        logprob_mask=[0, 1, 1, 1],
        advantages=[0, 1, 1, 1],
        old=old,
    )
    out = objective_loss(torch.tensor([old]), batch, ref_logprobs=reference)
    # k1 per token: 0.5, 0, 1.0; to go: 1.5, 1.0, 1.0. Ratios are 1: loss = -sum(A - 0.1 * to go).
    assert out.loss.item() == pytest.approx(-(0.85 + 0.9 + 0.9), abs=1e-6)
    assert out.metrics["kl"] == pytest.approx(0.5)


def test_dpo_is_the_logistic_loss_of_the_pairs_margin():
    # Two pairs (rows 0/1 and 2/3); each row's log-ratio to the reference is summed over its mask.
    logprobs = torch.tensor([[0.0, -1.0, -1.0], [0.0, -3.0, 0.0], [0.0, -2.0, -2.0], [0.0, -1.0, -1.0]])
    reference = torch.full((4, 3), -1.0)
    mask = np.array([[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 1, 1]], dtype=np.float32)
    batch = dataclasses.replace(
        train_batch(DpoObjective(beta=0.5), logprob_mask=[0, 1, 1]),
        loss_mask=mask,
        input_ids=np.zeros((4, 3), dtype=np.int64),
        loss_scale=0.5,
    )
    out = objective_loss(logprobs, batch, ref_logprobs=reference)
    # Log-ratios: 0, -2, -2, 0; margins 0.5 * (0 - -2) = 1 and 0.5 * (-2 - 0) = -1.
    expected = [math.log1p(math.exp(-1.0)), math.log1p(math.exp(1.0))]
    assert out.loss.item() == pytest.approx(0.5 * sum(expected), abs=1e-6)
    assert out.metrics["reward_accuracy"] == 0.5
    assert out.metrics["reward_margin"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="pairs"):
        objective_loss(
            logprobs[:3], dataclasses.replace(batch, loss_mask=mask[:3]), ref_logprobs=reference[:3]
        )


def ppo_batch(objective: PpoObjective, returns: list[float], old_values: list[float]) -> TrainBatch:
    batch = train_batch(objective, logprob_mask=[0, 1, 1], advantages=[0, 1, -1])
    as_row = functools.partial(np.asarray, dtype=np.float32)
    return dataclasses.replace(batch, returns=as_row([returns]), old_values=as_row([old_values]))


def test_ppo_clips_the_value_change_around_the_old_values():
    # Old values 0; returns 1 and -1. Value 0.5 moved 0.5 past the clip 0.2: the clipped 0.2
    # is further from the return, so its error counts (and the gradient stops); -0.1 is
    # inside the clip and counts as is.
    objective = PpoObjective(value_clip=0.2, value_coef=0.5)
    batch = ppo_batch(objective, returns=[0, 1, -1], old_values=[0, 0, 0])
    values = torch.tensor([[0.0, 0.5, -0.1]], requires_grad=True)
    logprobs = torch.zeros(1, 3)
    out = objective_loss(logprobs, batch, values=values)
    errors = [max((0.5 - 1) ** 2, (0.2 - 1) ** 2), (-0.1 + 1) ** 2]
    assert out.metrics["value_loss"] == pytest.approx(0.5 * sum(errors) / 2)
    assert out.metrics["value_clip_fraction"] == 0.5
    # The policy term: ratio 1, advantages +1 and -1 cancel.
    assert out.loss.item() == pytest.approx(0.5 * 0.5 * sum(errors), abs=1e-6)
    out.loss.backward()
    assert values.grad[0, 1].item() == 0.0
    assert values.grad[0, 2].item() == pytest.approx(0.5 * (-0.1 + 1), abs=1e-6)


def test_ppo_critic_warm_up_trains_only_the_values():
    objective = PpoObjective(train_policy=False)
    batch = ppo_batch(objective, returns=[0, 1, 1], old_values=[0, 0, 0])
    logprobs = torch.zeros(1, 3, requires_grad=True)
    values = torch.zeros(1, 3, requires_grad=True)
    out = objective_loss(logprobs, batch, values=values)
    out.loss.backward()
    assert logprobs.grad is None and values.grad.abs().sum() > 0
    assert "clip_fraction" not in out.metrics
    with pytest.raises(ValueError, match="value head"):
        objective_loss(logprobs, batch)


# token_logprobs


def test_token_logprobs_are_shifted_by_one():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, generator=generator)
    ids = torch.randint(0, 7, (2, 4), generator=generator)
    got = token_logprobs(logits, ids, temperature=2.0)
    assert got.shape == (2, 4)
    assert torch.all(got[:, 0] == 0)
    expected = torch.log_softmax(logits / 2.0, dim=-1)
    for b in range(2):
        for t in range(1, 4):
            assert got[b, t].item() == pytest.approx(expected[b, t - 1, ids[b, t]].item(), abs=1e-6)
