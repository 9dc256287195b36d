"""End to end: multi-turn episodes train on exactly the token ids the engine sampled, with a
byte-level BPE tokenizer for which decoding and re-encoding generated ids is not the identity.

The character tokenizer of the other multi-turn test round-trips every text, so a trainer that
re-tokenised the decoded turns would pass it too. Here the tokenizer has merges and 256 byte
tokens: a sampled ``"ba" "na"`` decodes to ``"bana"``, which encodes as one merged token, and
a lone UTF-8 lead byte decodes to U+FFFD, which encodes as three other bytes. The test checks
the logged trajectories against what the policy recorded while sampling, and that such
non-round-tripping turns really occurred in the run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from tests.e2e.harness import (
    FIXTURES,
    ROLLOUT,
    apply,
    e2e_config,
    metrics,
    read_jsonl,
    run,
    samples,
    write_toml,
)
from tests.fixtures.token_exactness_plugins import echo_observation

PAD, EOS = "<pad>", "<eos>"
PROMPTS = ["tell me about the fox", "héllo wörld, say something", "bakemo tasuri zo"]
MAX_TURNS = 3
STEPS = 3
EPISODES_PER_STEP = 16  # prompts_per_step * group_size, all logged


def train_bpe_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE (all 256 bytes, ~680 merges) trained on seeded pseudo-words."""
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=2,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=EOS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(directory))
    return tokenizer


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny seeded Llama and its BPE tokenizer, loadable with ``from_pretrained``."""
    if not ROLLOUT.exists():
        pytest.fail(f"{ROLLOUT} is missing: run scripts/setup.sh (or set ROLLOUT_BIN)")
    directory = tmp_path_factory.mktemp("bpe-model")
    tokenizer = train_bpe_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(directory))
    return directory


def bpe_config(directory: Path, model_dir: Path) -> Path:
    """The base config's shape on the BPE model and the recording policy, in the echoing
    environment (no [[rewards]]), every episode logged, no SFT warm start."""
    data = directory / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    overrides = {
        "run": {"name": None, "seed": 11, "steps": STEPS, "log_samples": EPISODES_PER_STEP},
        "python.paths": [FIXTURES],
        "policy": {
            "plugin": "token_exactness_plugins:RecordingHFCausalLM",
            "options.record_path": directory / "sampled.jsonl",
        },
        "data.options.template": None,
        "environment": {"plugin": "token_exactness_plugins:EchoTurns", "max_turns": MAX_TURNS},
        "rewards": None,
        "rollout": {"prompts_per_step": 2, "group_size": 8, "max_new_tokens": 8, "temperature": 1.0},
        "train": {"learning_rate": 0.01, "micro_batch_tokens": None},
        "sft": None,
        "checkpoint": None,
    }
    return write_toml(directory / "bpe.toml", apply(e2e_config(directory, model_dir, data), overrides))


def segments(tokens: list[int], generated: list[bool]) -> list[tuple[bool, list[int]]]:
    """Maximal runs of generated and of context tokens, in order."""
    runs: list[tuple[bool, list[int]]] = []
    for token, flag in zip(tokens, generated, strict=True):
        if runs and runs[-1][0] == flag:
            runs[-1][1].append(token)
        else:
            runs.append((flag, [token]))
    return runs


def test_multi_turn_trajectories_keep_the_sampled_ids_of_a_bpe_tokenizer(
    tmp_path: Path, bpe_model: Path
) -> None:
    config = bpe_config(tmp_path, bpe_model)
    run(config, "--overwrite")
    assert [line["step"] for line in metrics(tmp_path)] == list(range(1, STEPS + 1))
    tokenizer = AutoTokenizer.from_pretrained(bpe_model)
    special = set(tokenizer.all_special_ids)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # No BOS is added, so the policy encodes prompts exactly as `encode` does.
    assert tokenizer("a", add_special_tokens=True)["input_ids"] == encode("a")

    def decode(ids: list[int]) -> str:
        # What the policy hands the environment (HFCausalLM.decode).
        return tokenizer.decode(ids, skip_special_tokens=True)

    # Every token the engine had the policy sample, keyed by the exact ids it was sampled after.
    sampled_after: dict[tuple[int, ...], set[int]] = {}
    rows = read_jsonl(tmp_path / "sampled.jsonl")
    assert rows, "the sampling engine never ran the recording policy"
    for row in rows:
        assert row["drafts"] == 0 and len(row["sampled"]) == 1, row
        assert -1 not in row["context"], "a context slot was read before anything was written to it"
        sampled_after.setdefault(tuple(row["context"]), set()).add(row["sampled"][0])

    logged = samples(tmp_path)
    assert len(logged) == STEPS * EPISODES_PER_STEP
    turns_checked = 0
    not_round_tripping: list[tuple[list[int], list[int]]] = []
    merged_across_tokens: list[tuple[list[int], list[int]]] = []
    episodes_not_round_tripping = 0
    for sample in logged:
        tokens, generated = sample["tokens"], sample["generated"]
        assert len(tokens) == len(generated)
        # 1. Every trained (generated) token is the one the engine sampled after exactly the
        #    preceding ids of the trajectory: nothing was re-tokenised, dropped or inserted.
        for index, flag in enumerate(generated):
            if flag:
                choices = sampled_after.get(tuple(tokens[:index]))
                assert choices is not None, f"no sampling step saw the context of position {index}"
                assert tokens[index] in choices, (index, tokens[index], choices)
        # 2. The trajectory is prompt, then turns and observations alternating; the context
        #    spans are exactly the separately encoded prompt and observations, and each
        #    observation quotes the decoded ids of the turn before it.
        runs = segments(tokens, generated)
        assert [flag for flag, _ in runs] == [False] + [True, False] * (MAX_TURNS - 1) + [True]
        assert runs[0][1] == encode(sample["prompt"])
        assert sample["prompt"] in PROMPTS
        turns = [ids for flag, ids in runs if flag]
        observations = [ids for flag, ids in runs[1:] if not flag]
        for turn, observation in zip(turns, observations, strict=False):
            assert observation == encode(echo_observation(decode(turn)))
        # 3. Collect the turns whose text does not give back their ids.
        for turn in turns:
            turns_checked += 1
            again = encode(decode(turn))
            if again != turn:
                not_round_tripping.append((turn, again))
                text = decode(turn)
                if "\ufffd" not in text and not special & set(turn):
                    merged_across_tokens.append((turn, again))
        if encode(tokenizer.decode(tokens)) != tokens:
            episodes_not_round_tripping += 1

    assert turns_checked == STEPS * EPISODES_PER_STEP * MAX_TURNS
    # The run really exercised the case this test is about: turns that re-tokenise to other
    # ids, including ones whose text is valid and only tokenises with different merges.
    assert not_round_tripping, "every sampled turn round-tripped: the test proves nothing"
    assert merged_across_tokens, (
        f"no turn re-tokenised through merges alone ({len(not_round_tripping)} did through"
        " invalid UTF-8): the test would not catch a re-tokenising trainer on valid text"
    )
    assert episodes_not_round_tripping > 0
