"""Files for the offline quickstart: a character tokenizer, a tiny Llama and an addition dataset.

``python -m python_plugins.quickstart DIR [--force]`` writes ``DIR/model``,
``DIR/data/{train,test}.jsonl``, the chat model ``DIR/chat_model`` (the same tokenizer with
role markers and a chat template), ``DIR/data/{chat,calc}_train.jsonl`` (for
``configs/chat.toml`` and ``configs/tool_use.toml``) and ``DIR/quickstart.toml``
(``configs/quickstart.toml`` with the model and data paths under ``DIR``, so an installed
``rollout`` needs no clone of the repository to run it); the `rollout` binary calls
:func:`create`. Everything is seeded, so the same arguments always give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import string
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_ALPHABET",
    "addition_records",
    "calc_records",
    "chat_addition_records",
    "create",
    "create_char_tokenizer",
    "create_chat_tokenizer",
    "create_tiny_chat_model",
    "create_tiny_model",
    "main",
    "quickstart_config",
    "write_addition_dataset",
    "write_addition_splits",
    "write_chat_datasets",
]

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
DEFAULT_ALPHABET = string.digits + "+-=*/ " + string.ascii_lowercase + ".,:;?!'\"()\n"
TRAIN_EXAMPLES = 4000
TEST_EXAMPLES = 200
# About 4M parameters: learns 2-digit addition smoothly enough that a fixed number of SFT
# steps lands at a predictable accuracy on a 2-core CPU.
QUICKSTART_MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4}


def create_char_tokenizer(directory: str | Path, alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """Save a tokenizer with one token per character of ``alphabet`` and ``<pad> <eos> <unk>``.

    ``<eos>`` doubles as the BOS token, which is never added automatically.
    """
    characters = list(dict.fromkeys(alphabet))
    vocab = {token: index for index, token in enumerate([PAD, EOS, UNK, *characters])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def create_tiny_model(
    directory: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_positions: int = 128,
    seed: int = 0,
    alphabet: str = DEFAULT_ALPHABET,
) -> LlamaForCausalLM:
    """Save a randomly initialised Llama (seeded) and its character tokenizer in ``directory``.

    ``intermediate_size`` defaults to four times ``hidden_size``.
    """
    tokenizer = create_char_tokenizer(directory, alphabet)
    return _save_tiny_llama(
        directory,
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_positions=max_positions,
        seed=seed,
    )


def _save_tiny_llama(
    directory: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int | None,
    max_positions: int,
    seed: int,
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(directory))
    return model


def addition_records(count: int, *, seed: int, digits: int = 2) -> list[dict[str, str]]:
    """``count`` distinct ``{"question": "a+b=", "answer": "a+b"}`` with operands below 10**digits."""
    operands = 10**digits
    if count > operands * operands:
        raise ValueError(
            f"only {operands * operands} distinct {digits}-digit additions exist, asked for {count}"
        )
    pairs = random.Random(seed).sample(range(operands * operands), count)
    return [
        {"question": f"{p // operands}+{p % operands}=", "answer": str(p // operands + p % operands)}
        for p in pairs
    ]


def write_addition_dataset(path: str | Path, *, count: int, seed: int, digits: int = 2) -> Path:
    """Write ``count`` distinct addition problems as JSONL to ``path``."""
    return _write_jsonl(path, addition_records(count, seed=seed, digits=digits))


def write_addition_splits(
    directory: str | Path, *, train: int, test: int, seed: int, digits: int = 2
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` in ``directory``; no question is in both."""
    records = addition_records(train + test, seed=seed, digits=digits)
    train_path = _write_jsonl(Path(directory) / "train.jsonl", records[:train])
    test_path = _write_jsonl(Path(directory) / "test.jsonl", records[train:])
    return train_path, test_path


def _write_jsonl(path: str | Path, records: Iterable[Mapping[str, Any]]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(json.dumps(record) + "\n" for record in records))
    return target


# The chat model: the same character tokenizer plus role markers (special tokens, dropped when
# decoding), an end-of-turn token that is also the EOS, a BOS the tokenizer puts in front of
# every text, `<tool_call>` tags (ordinary added tokens: a turn's decoded text keeps them),
# and a Jinja chat template. One line per message; `tools` are listed by name.
CHAT_BOS, CHAT_EOS = "<s>", "<|end|>"
CHAT_ROLES = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
CHAT_ALPHABET = DEFAULT_ALPHABET + "{}[]_"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "{{ eos_token + '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message.role + '|>' + message.content + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT_MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "max_positions": 256}
# configs/chat.toml's task: all 100 single-digit additions. The ~0.5M-parameter chat model
# gets part of the table from its short warm start, and GRPO learns more of it.
CHAT_DIGITS = 1
CHAT_TRAIN_EXAMPLES = 100
CALC_TRAIN_EXAMPLES = 4000
CALC_SYSTEM_PROMPT = "use calc."


def create_chat_tokenizer(directory: str | Path, alphabet: str = CHAT_ALPHABET) -> PreTrainedTokenizerFast:
    """Save a character tokenizer with role markers, BOS/EOS and a chat template (see above)."""
    characters = list(dict.fromkeys(alphabet))
    specials = [PAD, CHAT_BOS, CHAT_EOS, UNK, *CHAT_ROLES]
    tags = ["<tool_call>", "</tool_call>"]
    vocab = {token: index for index, token in enumerate([*specials, *tags, *characters])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{CHAT_BOS} $A", special_tokens=[(CHAT_BOS, vocab[CHAT_BOS])]
    )
    backend.add_special_tokens([AddedToken(token, special=True) for token in specials])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in tags])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=CHAT_EOS,
        bos_token=CHAT_BOS,
        unk_token=UNK,
        additional_special_tokens=list(CHAT_ROLES),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def create_tiny_chat_model(directory: str | Path, *, seed: int = 0, **sizes: int) -> LlamaForCausalLM:
    """Save a randomly initialised Llama (seeded) with the chat tokenizer in ``directory``."""
    tokenizer = create_chat_tokenizer(directory)
    shape = {**CHAT_MODEL, **sizes}
    return _save_tiny_llama(
        directory, tokenizer, intermediate_size=shape.pop("intermediate_size", None), seed=seed, **shape
    )


def chat_addition_records(count: int, *, seed: int, digits: int = CHAT_DIGITS) -> list[dict[str, Any]]:
    """The addition problems as chat: ``{"messages": [user "a+b="], "answer": "a+b"}``."""
    return [
        {"messages": [{"role": "user", "content": record["question"]}], "answer": record["answer"]}
        for record in addition_records(count, seed=seed, digits=digits)
    ]


def calc_records(count: int, *, seed: int) -> list[dict[str, Any]]:
    """Two-digit multiplications to answer with the ``calc`` tool (python_plugins.tool_use).

    Half open the conversation (``target``: the tool call), half continue it after the call
    and its result (``target``: the answer): an SFT warm start on ``target`` teaches both
    halves, and each record is also an episode for the ``Calculator`` environment.
    """
    from python_plugins.tool_use import CALC_TOOL

    rng = random.Random(seed)
    records = []
    for index in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        answer = str(a * b)
        call = json.dumps({"name": "calc", "arguments": {"expr": f"{a}*{b}"}}, separators=(",", ":"))
        call = f"<tool_call>{call}</tool_call>"
        messages = [
            {"role": "system", "content": CALC_SYSTEM_PROMPT},
            {"role": "user", "content": f"{a}*{b}?"},
        ]
        if index % 2:
            messages += [{"role": "assistant", "content": call}, {"role": "tool", "content": answer}]
        target = answer if index % 2 else call
        records.append({"messages": messages, "tools": [CALC_TOOL], "answer": answer, "target": target})
    return records


def write_chat_datasets(directory: str | Path, *, seed: int) -> tuple[Path, Path]:
    """Write ``chat_train.jsonl`` (single-digit chat addition) and ``calc_train.jsonl`` (tool use)."""
    chat = _write_jsonl(
        Path(directory) / "chat_train.jsonl", chat_addition_records(CHAT_TRAIN_EXAMPLES, seed=seed)
    )
    calc = _write_jsonl(Path(directory) / "calc_train.jsonl", calc_records(CALC_TRAIN_EXAMPLES, seed=seed))
    return chat, calc


# configs/quickstart.toml with the model and data paths as placeholders (a test checks the two
# agree): what `rollout run DIR/quickstart.toml` runs after `rollout init-quickstart --dir DIR`.
QUICKSTART_CONFIG = """\
# The quickstart (configs/quickstart.toml in the repository), written by
# `rollout init-quickstart`: a tiny Llama-style model learns two-digit addition. A short
# supervised warm start gives it a first foothold, then GRPO raises the exact-match reward.
# Run it with `rollout run {config}`; output_dir is relative to the working directory.

[run]
name = "quickstart"
output_dir = "runs/quickstart"
seed = 0
steps = 150

[policy]
plugin = "python_plugins.hf_policy:HFCausalLM"
options = {{ model_path = {model}, torch_threads = 2 }}

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = {train}, template = "{{question}}" }}

[[rewards]]
plugin = "python_plugins.rewards:ExactMatch"

[[callbacks]]
plugin = "python_plugins.callbacks:ConsoleProgress"
options = {{ every = 10 }}

[rollout]
prompts_per_step = 32
group_size = 8
max_new_tokens = 6
temperature = 1.0

[algorithm]
advantage = "group_norm"

[train]
learning_rate = 5e-5
micro_batch_tokens = 4096

[sft]
steps = 400
batch_size = 64
learning_rate = 5e-4

[checkpoint]
every = 50
keep = 2
"""


def quickstart_config(directory: str | Path) -> str:
    """The quickstart's run config for the model and data under ``directory`` (absolute paths)."""
    root = Path(directory).resolve()
    return QUICKSTART_CONFIG.format(
        config=root / "quickstart.toml",
        model=json.dumps(str(root / "model")),
        train=json.dumps(str(root / "data" / "train.jsonl")),
    )


def create(directory: str, force: bool) -> dict[str, Any]:
    """Write the quickstart model and data under ``directory`` unless present (or ``force``).

    Returns the paths of the model directory, the two splits and the run config, and the
    parameter count.
    """
    return _create(Path(directory), force)[0]


def _create(root: Path, force: bool) -> tuple[dict[str, Any], list[str]]:
    """:func:`create`, also returning which of its paths were (re)written."""
    model_dir, data_dir = root / "model", root / "data"
    weights, train, test = model_dir / "model.safetensors", data_dir / "train.jsonl", data_dir / "test.jsonl"
    config = root / "quickstart.toml"
    written = []
    if force or not weights.exists():
        create_tiny_model(model_dir, **QUICKSTART_MODEL)
        written.append(str(model_dir))
    if force or not (train.exists() and test.exists()):
        write_addition_splits(data_dir, train=TRAIN_EXAMPLES, test=TEST_EXAMPLES, seed=0)
        written += [str(train), str(test)]
    if force or not config.exists():
        config.write_text(quickstart_config(root))
        written.append(str(config))
    # The chat model and its data (configs/chat.toml, configs/tool_use.toml).
    chat_dir = root / "chat_model"
    chat_train, calc_train = data_dir / "chat_train.jsonl", data_dir / "calc_train.jsonl"
    if force or not (chat_dir / "model.safetensors").exists():
        create_tiny_chat_model(chat_dir)
        written.append(str(chat_dir))
    if force or not (chat_train.exists() and calc_train.exists()):
        write_chat_datasets(data_dir, seed=0)
        written += [str(chat_train), str(calc_train)]
    paths = {
        "model": str(model_dir),
        "train": str(train),
        "test": str(test),
        "config": str(config),
        "chat_model": str(chat_dir),
        "chat_train": str(chat_train),
        "calc_train": str(calc_train),
    }
    return {**paths, "parameters": _count_parameters(weights)}, written


def _count_parameters(weights: Path) -> int:
    with safe_open(str(weights), framework="pt") as tensors:
        return sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m python_plugins.quickstart", description=__doc__)
    parser.add_argument("directory", help="where to write model/ and data/")
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist")
    args = parser.parse_args(argv)
    result, written = _create(Path(args.directory), args.force)
    for key in ("model", "train", "test", "config", "chat_model", "chat_train", "calc_train"):
        action = "wrote" if result[key] in written else "kept (exists; --force rewrites)"
        print(f"{key:<10} {result[key]}: {action}")
    print(f"the model has {result['parameters']:,} parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
