"""End to end: the Rust-scheduled sampling engine driving the real HF model, against HF
``generate`` and a teacher-forced forward pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from python_plugins.quickstart import create_tiny_model
from tests.e2e.harness import apply, e2e_config, read_jsonl, rollout, write_toml

PROMPTS = [
    "12+34=",
    "the number is 7 and the",
    "abc abc abc abc",
    "9",
    "guess: 3 lower. guess: 2 lower. guess:",
    "hello hello",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("engine-model")
    create_tiny_model(directory, hidden_size=64, num_layers=2, num_heads=4, max_positions=256, seed=3)
    return directory


@pytest.fixture(scope="module")
def hf_greedy(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            out = model.generate(
                ids, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0
            )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def generate(
    tmp_path: Path, model_dir: Path, *overrides: str, temperature: float = 0.0
) -> tuple[list[dict], dict]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    # The base config's policy and data (without a template), sampling only: no run or training.
    sampling = {
        "run": None,
        "data.options.template": None,
        "rewards": [{"plugin": "python_plugins.rewards:Format", "options": {"pattern": ".*"}}],
        "rollout": {
            "prompts_per_step": None,
            "group_size": 3,
            "max_new_tokens": NEW_TOKENS,
            "temperature": temperature,
            "ignore_eos": True,
        },
        "train": None,
        "sft": None,
        "checkpoint": None,
    }
    config = write_toml(tmp_path / "engine.toml", apply(e2e_config(tmp_path, model_dir, data), sampling))
    output = tmp_path / "completions.jsonl"
    args = ["--output", str(output)]
    for override in overrides:
        args += ["--set", override]
    result = rollout("generate", config, *args, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    return read_jsonl(output), stats


def by_prompt(completions: list[dict]) -> dict[int, list[list[int]]]:
    grouped: dict[int, list[list[int]]] = {}
    for completion in completions:
        grouped.setdefault(completion["prompt_index"], []).append(completion["token_ids"])
    return grouped


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param((), id="continuous-batching"),
        pytest.param(("engine.prefix_caching=false",), id="no-prefix-cache"),
        pytest.param(("engine.max_batch_tokens=8", "engine.max_running=4"), id="chunked-prefill"),
        pytest.param(('engine.speculation.method="ngram"',), id="ngram-speculation"),
        pytest.param(("engine.kv_cache_bytes=65536", "engine.block_size=4"), id="preemption"),
        pytest.param(('policy.options.engine_matmuls="weight_first"',), id="weight-first-matmuls"),
    ],
)
def test_greedy_matches_hf_generate(
    tmp_path: Path, model_dir: Path, hf_greedy: list[list[int]], overrides
) -> None:
    overrides = [
        f"policy.options.draft_model_path={model_dir}" if o == "SELF_DRAFT" else o for o in overrides
    ]
    completions, stats = generate(tmp_path, model_dir, *overrides)
    grouped = by_prompt(completions)
    assert sorted(grouped) == list(range(len(PROMPTS)))
    for index, expected in enumerate(hf_greedy):
        assert grouped[index] == [expected] * 3, f"prompt {index}: {PROMPTS[index]!r}"
    # Each group's prompt is prefilled once, not once per sample.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_tokens = sum(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS)
    assert stats["engine/prompt_tokens_requested"] == prompt_tokens
    if stats["engine/preemptions"] == 0:
        assert stats["engine/prompt_tokens_computed"] <= prompt_tokens
    if "preemption" in str(overrides):
        assert stats["engine/preemptions"] > 0
    if "ngram" in str(overrides):
        assert stats["engine/drafted_tokens"] > 0 and stats["engine/accepted_tokens"] > 0
    if "draft_model" in str(overrides):
        # The target drafting for itself: every draft is accepted.
        assert stats["engine/drafted_tokens"] > 0
        assert stats["engine/acceptance_rate"] == 1.0


def test_sampled_logprobs_equal_teacher_forcing(tmp_path: Path, model_dir: Path) -> None:
    completions, _ = generate(tmp_path, model_dir, "rollout.top_k=20", temperature=0.8)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    distinct = set()
    for completion in completions:
        prompt = tokenizer(PROMPTS[completion["prompt_index"]], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + completion["token_ids"]])
        with torch.inference_mode():
            logits = model(ids).logits[0, len(prompt) - 1 : -1] / 0.8
        expected = torch.log_softmax(logits, dim=-1).gather(
            -1, torch.tensor(completion["token_ids"])[:, None]
        )
        assert torch.allclose(torch.tensor(completion["logprobs"]), expected[:, 0], atol=1e-4)
        distinct.add(tuple(completion["token_ids"]))
    assert len(distinct) > len(PROMPTS), "samples of a group should differ"


def test_sampling_is_reproducible_and_independent_of_scheduling(tmp_path: Path, model_dir: Path) -> None:
    roomy_dir, cramped_dir = tmp_path / "roomy", tmp_path / "cramped"
    roomy_dir.mkdir()
    cramped_dir.mkdir()
    roomy, _ = generate(roomy_dir, model_dir, temperature=1.0)
    cramped, stats = generate(
        cramped_dir, model_dir, "engine.kv_cache_bytes=65536", "engine.block_size=4", temperature=1.0
    )
    assert stats["engine/preemptions"] > 0
    assert by_prompt(roomy) == by_prompt(cramped)


def test_stop_strings_end_completions_at_the_matching_token(
    tmp_path: Path, model_dir: Path, hf_greedy: list[list[int]]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.decode(hf_greedy[0])
    stop = text[3:5]
    completions, _ = generate(tmp_path, model_dir, f"rollout.stop_strings=[{json.dumps(stop)}]")
    for completion in completions:
        if completion["prompt_index"] != 0:
            continue
        tokens = completion["token_ids"]
        assert completion["finish_reason"] == "stop"
        assert stop in tokenizer.decode(tokens)
        assert stop not in tokenizer.decode(tokens[:-1]), "generation went on past the stop string"
        assert tokens == hf_greedy[0][: len(tokens)]
