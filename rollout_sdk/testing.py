"""Conformance checks a plugin author runs from plain pytest, without the `rollout` binary.

Each ``check_*`` exercises one plugin the way the engine will and raises
:class:`PluginCheckError` naming the broken promise::

    from rollout_sdk.testing import check_reward, load_plugin

    def test_my_reward():
        reward = load_plugin("my_pkg.rewards:Length", {"target": 10})
        check_reward(reward, [Sample(prompt="p", completion="c")])
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rollout_sdk.data import DataSource, Pipeline, Record, Transform
from rollout_sdk.environment import Environment, StepResult
from rollout_sdk.multi_agent import AgentTurn, JointStepResult, MultiAgentEnvironment
from rollout_sdk.plugin import load_plugin
from rollout_sdk.policy import Policy
from rollout_sdk.reward import Reward, SampleFailure
from rollout_sdk.snapshot import HostTensor, Snapshot, TensorFile, write_snapshot
from rollout_sdk.types import (
    Generation,
    GenerationRequest,
    GrpoObjective,
    PpoObjective,
    Sample,
    SamplingParams,
    TokenBatch,
    TrainBatch,
)
from rollout_sdk.weights import StreamedWeights

__all__ = [
    "PluginCheckError",
    "check_data_source",
    "check_environment",
    "check_multi_agent_environment",
    "check_policy",
    "check_reward",
    "load_plugin",
]


class PluginCheckError(AssertionError):
    """A plugin broke a promise of the SDK contract."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise PluginCheckError(message)


def check_reward(reward: Reward, samples: Sequence[Sample]) -> list[float | SampleFailure]:
    """Score ``samples`` twice; require one finite float (or a :class:`SampleFailure`) each,
    the same both times."""
    first = [_score_value(x) for x in reward.score(samples)]
    _require(len(first) == len(samples), f"score returned {len(first)} values for {len(samples)} samples")
    _require(
        all(isinstance(x, SampleFailure) or math.isfinite(x) for x in first),
        f"score returned a non-finite value: {first}",
    )
    second = [_score_value(x) for x in reward.score(samples)]
    _require(first == second, "score is not deterministic for the same samples")
    return first


def _score_value(value: Any) -> float | SampleFailure:
    return value if isinstance(value, SampleFailure) else float(value)


def check_data_source(source: DataSource, transforms: Sequence[Transform] = ()) -> list[Record]:
    """Read every record through the pipeline; require a ``prompt`` string and JSON values."""
    records = list(Pipeline(transforms)(source.records()))
    _require(len(records) > 0, "the data source yielded no records")
    for index, record in enumerate(records):
        _require(isinstance(record.get("prompt"), str), f"record {index} has no string `prompt`")
        try:
            json.dumps(dict(record))
        except (TypeError, ValueError) as err:
            raise PluginCheckError(f"record {index} is not JSON-serialisable: {err}") from None
    again = list(Pipeline(transforms)(source.records()))
    _require(again == records, "the data source does not yield the same records twice")
    return records


def check_environment(
    make_env: Callable[[], Environment], record: Record, actions: Sequence[str], *, seed: int = 0
) -> list[StepResult]:
    """Play ``actions`` in two fresh episodes with the same seed; require identical results."""

    def play() -> tuple[str, list[StepResult]]:
        env = make_env()
        prompt = env.reset(record, seed=seed)
        _require(isinstance(prompt, str), "reset must return the first prompt as a string")
        results = []
        for action in actions:
            result = env.step(action)
            _require(isinstance(result, StepResult), "step must return a StepResult")
            _require(math.isfinite(result.reward), f"step returned a non-finite reward {result.reward}")
            results.append(result)
            if result.done:
                break
        return prompt, results

    first, second = play(), play()
    _require(first == second, "two episodes with the same seed and actions differ")
    return first[1]


def check_multi_agent_environment(
    make_env: Callable[[], MultiAgentEnvironment],
    record: Record,
    actions: Sequence[str],
    *,
    seed: int = 0,
) -> list[tuple[AgentTurn, JointStepResult]]:
    """Play ``actions`` (one per turn, whoever acts) in two fresh episodes with the same seed;
    require turns of declared agents, finite rewards to declared agents and identical
    episodes. Returns each turn with the environment's answer."""

    def play() -> list[tuple[AgentTurn, JointStepResult]]:
        env = make_env()
        agents = set(type(env).agents)
        _require(bool(agents), f"{type(env).__name__}.agents names no agent")
        turn: AgentTurn | None = env.reset(record, seed=seed)
        played = []
        for action in actions:
            if turn is None:
                break
            _require(isinstance(turn, AgentTurn), "reset and next_turn must be AgentTurn (or None)")
            _require(
                turn.agent in agents, f"turn of undeclared agent {turn.agent!r} (agents: {sorted(agents)})"
            )
            _require(isinstance(turn.prompt, str), "an AgentTurn's prompt must be a string")
            result = env.step(action)
            _require(isinstance(result, JointStepResult), "step must return a JointStepResult")
            for agent, reward in result.rewards.items():
                _require(agent in agents, f"reward for undeclared agent {agent!r}")
                _require(math.isfinite(reward), f"step returned a non-finite reward {reward} for {agent!r}")
            played.append((turn, result))
            turn = result.next_turn
        return played

    first, second = play(), play()
    _require(first == second, "two episodes with the same seed and actions differ")
    return first


def check_policy(
    policy: Policy, prompts: Sequence[str], *, max_new_tokens: int = 8, atol: float = 1e-4
) -> None:
    """Exercise every Policy hook on ``prompts`` and check the arrays and invariants."""
    encoded = policy.encode(prompts)
    _require(len(encoded) == len(prompts), "encode returned the wrong number of sequences")
    requests = [GenerationRequest(prompt_ids=np.asarray(ids, dtype=np.int64), n=2) for ids in encoded]
    groups = _check_generation(policy, requests, max_new_tokens)
    completions = [(req, gen) for req, group in zip(requests, groups, strict=True) for gen in group]
    batch, teacher = _check_teacher_forcing(policy, completions, atol)
    before, after = _check_update(policy, completions, batch, teacher)
    _check_persistence(policy, before, after)


def _check_generation(
    policy: Policy, requests: list[GenerationRequest], max_new_tokens: int
) -> list[list[Generation]]:
    """Two seeded completions per prompt, well-formed, and the same when asked again."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=1234)
    groups = policy.generate(requests, params)
    _require(len(groups) == len(requests), "generate returned the wrong number of groups")
    for group in groups:
        _require(len(group) == 2, "generate returned the wrong number of completions for n=2")
        for gen in group:
            _require(gen.token_ids.dtype == np.int64, "token_ids must be int64")
            _require(gen.logprobs.dtype == np.float32, "logprobs must be float32")
            _require(gen.token_ids.shape == gen.logprobs.shape, "token_ids and logprobs differ in length")
            _require(1 <= len(gen.token_ids) <= max_new_tokens, "completion length outside 1..max_new_tokens")
            _require(bool(np.all(gen.logprobs <= 0.0)), "a logprob is positive")
    again = policy.generate(requests, params)
    same = all(
        np.array_equal(a.token_ids, b.token_ids)
        for ga, gb in zip(groups, again, strict=True)
        for a, b in zip(ga, gb, strict=True)
    )
    _require(same, "generate is not reproducible for the same seed")
    return groups


def _check_teacher_forcing(
    policy: Policy, completions: list[tuple[GenerationRequest, Generation]], atol: float
) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """The logprobs of each prompt + completion, teacher-forced, match the sampled ones."""
    sequences = [np.concatenate([req.prompt_ids, gen.token_ids]) for req, gen in completions]
    batch = _pad_batch(sequences)
    teacher = policy.logprobs(TokenBatch(input_ids=batch[0], attention_mask=batch[1]))
    _require(teacher.shape == batch[0].shape, "logprobs returned the wrong shape")
    for row, (req, gen) in enumerate(completions):
        start = len(req.prompt_ids)
        got = teacher[row, start : start + len(gen.token_ids)]
        _require(
            np.allclose(got, gen.logprobs, atol=atol),
            f"generation logprobs differ from teacher-forced ones by {np.abs(got - gen.logprobs).max():.2e}",
        )
    return batch, teacher


def _check_update(
    policy: Policy,
    completions: list[tuple[GenerationRequest, Generation]],
    batch: tuple[np.ndarray, np.ndarray],
    teacher: np.ndarray,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One GRPO micro-batch and update: a finite loss and changed weights. Returns the
    weights before and after."""
    before = policy.export_weights()
    loss_mask = np.zeros_like(batch[0], dtype=np.float32)
    for row, (req, gen) in enumerate(completions):
        loss_mask[row, len(req.prompt_ids) : len(req.prompt_ids) + len(gen.token_ids)] = 1.0
    advantages = np.where(np.arange(len(completions))[:, None] % 2 == 0, 1.0, -1.0) * loss_mask
    train = TrainBatch(
        input_ids=batch[0],
        attention_mask=batch[1],
        loss_mask=loss_mask,
        advantages=advantages.astype(np.float32),
        old_logprobs=(teacher * loss_mask).astype(np.float32),
        loss_scale=1.0 / float(loss_mask.sum()),
        objective=GrpoObjective(),
    )
    metrics = policy.train_step(train)
    _require(math.isfinite(float(metrics["loss"])), f"train_step returned a non-finite loss: {metrics}")
    policy.apply_update(1e-3)
    after = policy.export_weights()
    _require(set(before) == set(after), "export_weights names changed after an update")
    _require(any(not np.array_equal(before[k], after[k]) for k in before), "apply_update changed no weight")
    _check_values(policy, train, after)
    return before, after


def _check_persistence(policy: Policy, before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    """Weights come back through `import_weights` (streamed, as a sync hands them over),
    `save` + `load`, and a snapshot where the policy takes them."""
    try:
        snapshot = _copied(policy.snapshot())
    except NotImplementedError:
        snapshot = None
    with tempfile.TemporaryDirectory() as directory:
        policy.save(directory)
        policy.import_weights(StreamedWeights(iter(before.items())))
        restored = policy.export_weights()
        _require(
            all(np.array_equal(before[k], restored[k]) for k in before), "import_weights did not restore"
        )
        policy.load(directory)
        reloaded = policy.export_weights()
        _require(
            all(np.array_equal(after[k], reloaded[k]) for k in after), "load did not restore saved weights"
        )
    if snapshot is not None:
        _check_snapshot(policy, snapshot, before, after)


def _check_values(policy: Policy, train: TrainBatch, weights: dict[str, np.ndarray]) -> None:
    """A policy with a value head: its predictions' shape, and a critic warm-up update (PPO
    with ``train_policy=False``) that trains the head without moving the policy."""
    try:
        values = policy.values(train)
    except NotImplementedError:
        return
    _require(values.shape == train.input_ids.shape, "values returned the wrong shape")
    finite = values.dtype == np.float32 and bool(np.all(np.isfinite(values)))
    _require(finite, "values must be finite float32")
    returns = np.where(train.loss_mask > 0, 1.0, 0.0).astype(np.float32)
    warm_up = dataclasses.replace(
        train, objective=PpoObjective(train_policy=False), returns=returns, old_values=values
    )
    metrics = policy.train_step(warm_up)
    _require("value_loss" in metrics, "a PPO train_step reports no value_loss")
    policy.apply_update(1e-3)
    moved = policy.export_weights()
    _require(all(np.array_equal(weights[k], moved[k]) for k in weights), "a critic warm-up moved the policy")
    _require(not np.array_equal(policy.values(train), values), "a critic warm-up left the values unchanged")


def _copied(snapshot: Snapshot) -> dict[str, bytes | TensorFile]:
    """What the engine keeps of a snapshot when it returns: every tensor's bytes copied."""
    return {
        name: TensorFile(
            {key: HostTensor(t.dtype, t.shape, bytes(t.data)) for key, t in content.tensors.items()},
            content.metadata,
        )
        if isinstance(content, TensorFile)
        else content
        for name, content in snapshot.items()
    }


def _check_snapshot(
    policy: Policy,
    snapshot: Snapshot,
    before: dict[str, np.ndarray],
    after: dict[str, np.ndarray],
) -> None:
    """A snapshot taken at ``after``, written once the weights changed, must load as ``after``."""
    policy.import_weights(before)
    with tempfile.TemporaryDirectory() as directory:
        write_snapshot(snapshot, directory)
        policy.load(directory)
    reloaded = policy.export_weights()
    _require(
        all(np.array_equal(after[k], reloaded[k]) for k in after),
        "the files of snapshot() do not load as the weights it was taken at",
    )


def _pad_batch(sequences: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(s) for s in sequences)
    ids = np.zeros((len(sequences), width), dtype=np.int64)
    mask = np.zeros((len(sequences), width), dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask
