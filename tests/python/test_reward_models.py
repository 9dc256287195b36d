"""Learned rewards: the demo reward model, SequenceClassifierReward and GenerativeJudge."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from python_plugins.quickstart import create_char_tokenizer
from python_plugins.reward_models import create_demo_reward_model, demo_examples, read_number, render
from rollout_sdk import ConfigError, Sample
from rollout_sdk.testing import check_reward, load_plugin

CLASSIFIER = "python_plugins.reward_models:SequenceClassifierReward"
JUDGE = "python_plugins.reward_models:GenerativeJudge"


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """These models are tiny: one thread is as fast, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_rm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The demo reward model exactly as `create-demo` makes it (seeded, a few seconds)."""
    directory = tmp_path_factory.mktemp("demo_rm")
    return directory, create_demo_reward_model(directory)


@pytest.fixture(scope="session")
def three_label_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained classifier with three labels (random head, saved as safetensors)."""
    directory = tmp_path_factory.mktemp("three_label_rm")
    tokenizer = create_char_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=3,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(directory)
    return directory


# What the bigram judge below answers after a text that ends in the key (its last character).
JUDGE_ANSWERS = {"a": "8", "b": "9999", "c": "x", "d": "-3", "e": "4.5", "f": "12"}


@pytest.fixture(scope="session")
def bigram_judge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Llama whose greedy continuation depends only on the last token: attention and
    MLP outputs are zero, embeddings one-hot, and the LM head a table of next characters. Its
    answers to texts ending in each key of JUDGE_ANSWERS are known exactly."""
    directory = tmp_path_factory.mktemp("bigram_judge")
    tokenizer = create_char_tokenizer(directory)
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    assert vocab <= config.hidden_size
    model = LlamaForCausalLM(config)
    head = torch.zeros(vocab, config.hidden_size)
    head[tokenizer.eos_token_id, :] = 0.5  # any character without a successor ends the answer
    for key, answer in JUDGE_ANSWERS.items():
        chain = [key, *answer]
        for before, after in itertools.pairwise(chain):
            head[tokenizer.convert_tokens_to_ids(after), tokenizer.convert_tokens_to_ids(before)] = 1.0
    head[tokenizer.convert_tokens_to_ids("9"), tokenizer.convert_tokens_to_ids("9")] = 1.0  # 9999...
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, config.hidden_size))
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(directory)
    return directory


def samples_of(examples: list[tuple[str, str, bool]]) -> list[Sample]:
    return [Sample(prompt=prompt, completion=completion) for prompt, completion, _ in examples]


def test_demo_reward_model_prefers_completions_with_a_7(demo_rm: tuple[Path, dict]) -> None:
    directory, facts = demo_rm
    assert facts["held_out"]["accuracy"] >= 0.95
    reward = load_plugin(CLASSIFIER, {"model_path": str(directory), "normalize": "sigmoid"})
    examples = demo_examples(400, seed=12345)  # neither its training nor its held-out data
    scores = check_reward(reward, samples_of(examples))
    positive = [s for s, (_, _, has_7) in zip(scores, examples, strict=True) if has_7]
    negative = [s for s, (_, _, has_7) in zip(scores, examples, strict=True) if not has_7]
    assert sum(positive) / len(positive) - sum(negative) / len(negative) > 0.8
    # A 7 in the prompt is not a 7 in the completion.
    assert reward.score([Sample(prompt="7+7=", completion="14"), Sample(prompt="1+2=", completion="7")]) == [
        pytest.approx(0.0, abs=0.1),
        pytest.approx(1.0, abs=0.1),
    ]
    written = {path.suffix for path in directory.iterdir()}
    assert written == {".json", ".safetensors"}, "the demo is safetensors and JSON only"


def test_batched_scores_equal_one_by_one(demo_rm: tuple[Path, dict]) -> None:
    directory, _ = demo_rm
    completions = ["", "7", "12", "the answer is 17", "no", "77 77 77 77 77 77", "8", "abc def ghi"]
    samples = [Sample(prompt=p, completion=c) for p in ("3+4=", "12+34=") for c in completions]
    batched = load_plugin(CLASSIFIER, {"model_path": str(directory), "batch_size": 5}).score(samples)
    single = load_plugin(CLASSIFIER, {"model_path": str(directory), "batch_size": 1})
    one_by_one = [single.score([sample])[0] for sample in samples]
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    assert len(set(batched)) > 4, "the scores must differ between samples for this to mean anything"
    assert single.score([]) == []


def test_label_picks_the_logit_and_softmax_its_probability(three_label_rm: Path) -> None:
    samples = [Sample(prompt="1+1=", completion=c) for c in ("2", "3", "two")]
    path = str(three_label_rm)
    logits = [load_plugin(CLASSIFIER, {"model_path": path, "label": i}).score(samples) for i in range(3)]
    probabilities = [
        load_plugin(CLASSIFIER, {"model_path": path, "label": i, "normalize": "softmax"}).score(samples)
        for i in range(3)
    ]
    expected = torch.softmax(torch.tensor(logits).T, dim=-1).T.tolist()
    assert probabilities == [pytest.approx(row, abs=1e-6) for row in expected]
    assert logits[0] != logits[1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"label": 3}, r"label = 3 is out of range: the model at .* has 3 labels \(0 to 2\)"),
        ({}, r"has 3 labels: set `label` to the index \(0 to 2\)"),
    ],
)
def test_bad_label_is_a_clear_error(three_label_rm: Path, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_plugin(CLASSIFIER, {"model_path": str(three_label_rm), **options})


def test_one_label_head_rejects_other_labels_and_softmax(demo_rm: tuple[Path, dict]) -> None:
    path = str(demo_rm[0])
    with pytest.raises(ValueError, match=r"label = 1 is out of range: .* has 1 label \(0 to 0\)"):
        load_plugin(CLASSIFIER, {"model_path": path, "label": 1})
    with pytest.raises(ValueError, match="softmax' needs at least 2 labels"):
        load_plugin(CLASSIFIER, {"model_path": path, "normalize": "softmax"})


@pytest.mark.parametrize(
    ("options", "key", "message"),
    [
        ({"label": -1}, "label", "must not be negative"),
        ({"batch_size": 0}, "batch_size", "must be at least 1"),
        ({"template": "{prompt}"}, "template", r"must contain `\{completion\}`"),
        ({"template": "{}{completion}"}, "template", "must be named"),
        ({"device": "gpu"}, "device", "expected `cpu`, `auto`"),
        ({"model_path": "/nonexistent/rm"}, "model_path", "is not a directory"),
        ({"chat_template": True, "template": "{completion}"}, "template", "not used with chat_template"),
    ],
)
def test_options_are_validated(demo_rm: tuple[Path, dict], options: dict, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_plugin(CLASSIFIER, {"model_path": str(demo_rm[0]), **options})
    assert caught.value.key == (key,)


def test_a_causal_lm_or_a_missing_chat_template_is_refused(tiny_model_dir: Path, demo_rm: tuple) -> None:
    with pytest.raises(ValueError, match=r"lacks trained weights for score\.weight"):
        load_plugin(CLASSIFIER, {"model_path": str(tiny_model_dir)})
    with pytest.raises(ValueError, match="has no chat template"):
        load_plugin(CLASSIFIER, {"model_path": str(demo_rm[0]), "chat_template": True})


def test_template_reads_record_fields() -> None:
    sample = Sample(prompt="1+1=", completion="2", record={"answer": "2"})
    assert render("{prompt}{completion} (expected {answer})", sample) == "1+1=2 (expected 2)"
    with pytest.raises(KeyError, match=r"'solution' is neither prompt, completion nor a field .*`answer`"):
        render("{completion}{solution}", sample)


@pytest.mark.parametrize(
    ("text", "pattern", "expected"),
    [
        ("Score: 7/10", r"-?\d+(?:\.\d+)?", 7.0),
        (" -3.5 points", r"-?\d+(?:\.\d+)?", -3.5),
        ("no number here", r"-?\d+(?:\.\d+)?", None),
        ("1 of 3. Score: 8", r"Score: (\d+)", 8.0),
        ("inf or nan", r"[a-z]+", None),
    ],
)
def test_read_number(text: str, pattern: str, expected: float | None) -> None:
    assert read_number(text, re.compile(pattern)) == expected


def test_judge_parses_clips_and_falls_back(bigram_judge: Path) -> None:
    options = {"model_path": str(bigram_judge), "template": "{prompt}{completion}", "max_new_tokens": 4}
    judge = load_plugin(JUDGE, {**options, "fallback_score": -1.0, "batch_size": 4})
    # Prompts of different lengths, so a batch is left-padded.
    samples = [Sample(prompt="q" * (i + 1), completion=f"it is {key}") for i, key in enumerate(JUDGE_ANSWERS)]
    assert judge.answers(samples) == ["8", "9999", "x", "-3", "4.5", "12"]
    # 9999 and 12 clip to max_score, -3 to min_score; `x` has no number.
    assert check_reward(judge, samples) == [8.0, 10.0, -1.0, 0.0, 4.5, 10.0]
    assert [judge.score([sample])[0] for sample in samples] == [8.0, 10.0, -1.0, 0.0, 4.5, 10.0]
    normalised = load_plugin(JUDGE, {**options, "normalize": True, "min_score": 2, "max_score": 12})
    assert normalised.score(samples) == [0.6, 1.0, 0.0, 0.0, 0.25, 1.0]


def test_judge_batches_a_real_model_like_one_by_one(tiny_model_dir: Path) -> None:
    judge = load_plugin(JUDGE, {"model_path": str(tiny_model_dir), "template": "{prompt}{completion} score:"})
    samples = [Sample(prompt=p, completion=c) for p in ("1+2=", "12+34=") for c in ("", "3", "46 apples")]
    answers = judge.answers(samples)
    assert answers == [judge.answers([sample])[0] for sample in samples]
    assert all(answer for answer in answers), "an untrained model still says something"
    assert check_reward(judge, samples) == [judge.score_answer(answer) for answer in answers]


@pytest.mark.parametrize(
    ("options", "key", "message"),
    [
        ({"min_score": 5, "max_score": 5}, "max_score", "must exceed min_score"),
        ({"pattern": "(unclosed"}, "pattern", "not a valid regular expression"),
        ({"max_new_tokens": 0}, "max_new_tokens", "must be at least 1"),
    ],
)
def test_judge_options_are_validated(tiny_model_dir: Path, options: dict, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_plugin(JUDGE, {"model_path": str(tiny_model_dir), **options})
    assert caught.value.key == (key,)
