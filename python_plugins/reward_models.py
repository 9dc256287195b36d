"""Learned rewards: a reward model (a sequence classifier) and a generative judge, both local
Hugging Face models.

* :class:`SequenceClassifierReward` scores ``(prompt, completion)`` with an
  ``AutoModelForSequenceClassification`` directory: one logit (or its sigmoid / softmax) per sample.
* :class:`GenerativeJudge` asks a causal LM to grade the completion, generates a few tokens
  greedily and reads the first number of its answer.

Both load from a local directory (``from_pretrained``, safetensors), run batched in eval mode
without gradients, and work in the embedded interpreter as well as in ``[sandbox]`` processes.

``python -m python_plugins.reward_models create-demo DIR`` trains a tiny demo reward model
(seeded, a few seconds on a CPU) with the quickstart's character tokenizer that prefers
completions containing the digit 7.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import string
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as transformers_logging

from python_plugins.hub_cache import HubCacheMiss, resolve_model_path
from python_plugins.model_setup import require_safetensors
from python_plugins.quickstart import DEFAULT_ALPHABET, addition_records, create_char_tokenizer
from rollout_sdk import ConfigError, Reward, Sample

__all__ = [
    "DEMO_PROPERTY",
    "GenerativeJudge",
    "SequenceClassifierReward",
    "create_demo_reward_model",
    "demo_examples",
    "has_demo_property",
    "main",
    "read_number",
    "render",
]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Dtype = Literal["float32", "bfloat16", "float16"]
DEFAULT_JUDGE_TEMPLATE = (
    "Rate how well the answer solves the question, from 0 (wrong) to 10 (perfect).\n"
    "Question: {prompt}\nAnswer: {completion}\nScore:"
)
NUMBER = r"-?\d+(?:\.\d+)?"


# --- options shared by both plugins -----------------------------------------------------------


def _check_positive(config: Any, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise ConfigError((name,), f"must be at least 1, got {getattr(config, name)}")


def _check_common(config: Any) -> None:
    """Checks of the options both plugins have; errors name the option."""
    # A hub id (`org/name`) not on disk is read from the local Hugging Face cache.
    try:
        config.model_path = resolve_model_path(config.model_path)
    except HubCacheMiss as err:
        raise ConfigError(("model_path",), str(err)) from None
    if not Path(config.model_path).is_dir():
        raise ConfigError(("model_path",), f"`{config.model_path}` is not a directory (a local model)")
    _check_positive(config, "batch_size", "max_length")
    if config.torch_threads < 0:
        raise ConfigError(("torch_threads",), f"must not be negative, got {config.torch_threads}")
    if config.device not in ("cpu", "auto") and not re.fullmatch(r"(cuda|mps|xpu)(:\d+)?", config.device):
        raise ConfigError(("device",), f"expected `cpu`, `auto`, `cuda` or `cuda:N`, got `{config.device}`")
    _check_template(config.template)


def _check_template(template: str) -> None:
    """``template`` must be a format string of named fields, ``{completion}`` among them."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ConfigError(("template",), f"is not a valid format string: {err}") from None
    if any(not name or name.isdigit() for name in names):
        raise ConfigError(("template",), "every `{...}` field must be named, e.g. `{prompt}`, `{completion}`")
    if "completion" not in {re.split(r"[.\[]", name, maxsplit=1)[0] for name in names}:
        raise ConfigError(("template",), "must contain `{completion}`")


def render(template: str, sample: Sample) -> str:
    """``template`` formatted with ``prompt``, ``completion`` and the fields of ``sample.record``."""
    fields = {**sample.record, "prompt": sample.prompt, "completion": sample.completion}
    try:
        return template.format_map(fields)
    except KeyError as err:
        known = ", ".join(f"`{key}`" for key in fields)
        raise KeyError(
            f"template field {err} is neither prompt, completion nor a field of the record (fields: {known})"
        ) from None


def _set_threads(threads: int) -> None:
    """Set torch's CPU threads (process-wide: in the embedded interpreter the policy shares them)."""
    if threads > 0:
        torch.set_num_threads(threads)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device `{name}` was asked for, but torch sees no CUDA device (try `cpu`, `auto`)")
    return torch.device(name)


def _load_tokenizer(path: str, *, padding_side: str, truncation_side: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = padding_side
    tokenizer.truncation_side = truncation_side
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _check_chat_template(tokenizer: PreTrainedTokenizerBase, path: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat_template = true, but the tokenizer at `{path}` has no chat template; "
            "set chat_template = false and join prompt and completion with `template`"
        )


def _check_pad_token(tokenizer: PreTrainedTokenizerBase, batch_size: int, path: str) -> None:
    if tokenizer.pad_token_id is None and batch_size > 1:
        raise ValueError(f"the tokenizer at `{path}` has neither a pad nor an EOS token: set batch_size = 1")


def _load_model(loader: Any, path: str, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """``loader.from_pretrained`` in eval mode without gradients; a head it had to create is an error."""
    transformers_logging.disable_progress_bar()
    require_safetensors(path)
    model, info = loader.from_pretrained(path, dtype=dtype, use_safetensors=True, output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ValueError(
            f"the model at `{path}` lacks trained weights for {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''} (is it a {loader.__name__.removeprefix('AutoModelFor')} "
            "model? transformers would have initialised them at random)"
        )
    return model.to(device).eval().requires_grad_(False)


def _encode(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *, max_length: int, add_special_tokens: bool
) -> list[list[int]]:
    """Token ids of each text, truncated to ``max_length``; an empty text becomes one BOS/EOS/pad
    token so that it can still be scored."""
    if not texts:
        return []
    ids = tokenizer(
        list(texts), add_special_tokens=add_special_tokens, truncation=True, max_length=max_length
    )["input_ids"]
    specials = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    filler = next((token for token in specials if token is not None), 0)
    return [row if row else [filler] for row in ids]


def _batches(ids: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Indices of ``ids`` grouped into batches of similar length (less padding)."""
    order = sorted(range(len(ids)), key=lambda index: len(ids[index]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def _padded(
    tokenizer: PreTrainedTokenizerBase, rows: Sequence[Sequence[int]], device: torch.device
) -> dict[str, torch.Tensor]:
    batch = tokenizer.pad({"input_ids": [list(row) for row in rows]}, padding=True, return_tensors="pt")
    return {key: value.to(device) for key, value in batch.items()}


# --- SequenceClassifierReward ------------------------------------------------------------------


class SequenceClassifierReward(Reward):
    """A reward model: ``template`` joins prompt and completion, an
    ``AutoModelForSequenceClassification`` scores the text, and one of its logits is the score.

    ``label`` picks the logit; a one-output (regression) head needs none. ``normalize`` maps it
    to ``[0, 1]``: ``sigmoid`` of that logit, or ``softmax`` over the labels (its probability).
    Texts are right-padded and run in batches of ``batch_size`` (sorted by length), so a
    sample's score does not depend on the others in its batch.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        model_path: str
        device: str = "cpu"
        dtype: Dtype = "float32"
        batch_size: int = 16
        # Tokens per text at most; longer texts lose tokens on `truncation_side`.
        max_length: int = 1024
        truncation_side: Literal["left", "right"] = "left"
        # `{prompt}`, `{completion}` and any field of the data record, e.g. `{answer}`.
        template: str = "{prompt}{completion}"
        # Instead of `template`: a user turn with the prompt and an assistant turn with the
        # completion, rendered by the tokenizer's chat template.
        chat_template: bool = False
        add_special_tokens: bool = True
        # Which logit is the score; None for a one-output head.
        label: int | None = None
        normalize: Literal["none", "sigmoid", "softmax"] = "none"
        # CPU threads for torch; 0 keeps torch's default. Process-wide.
        torch_threads: int = 0

        def __post_init__(self) -> None:
            _check_common(self)
            if self.label is not None and self.label < 0:
                raise ConfigError(("label",), f"must not be negative, got {self.label}")
            if self.chat_template and self.template != "{prompt}{completion}":
                raise ConfigError(("template",), "is not used with chat_template = true: leave it out")

    def __init__(self, config: SequenceClassifierReward.Config) -> None:
        super().__init__(config)
        _set_threads(config.torch_threads)
        self.device = _resolve_device(config.device)
        self.tokenizer = _load_tokenizer(
            config.model_path, padding_side="right", truncation_side=config.truncation_side
        )
        if config.chat_template:
            _check_chat_template(self.tokenizer, config.model_path)
        _check_pad_token(self.tokenizer, config.batch_size, config.model_path)
        self.model = _load_model(
            AutoModelForSequenceClassification, config.model_path, self.device, TORCH_DTYPES[config.dtype]
        )
        if self.model.config.pad_token_id is None:
            # The head pools the last token that is not padding: it must know the pad id.
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.label = _choose_label(config, self.model.config.num_labels)

    def score(self, samples: Sequence[Sample]) -> list[float]:
        ids = _encode(
            self.tokenizer,
            [self.text(sample) for sample in samples],
            max_length=self.config.max_length,
            add_special_tokens=self.config.add_special_tokens and not self.config.chat_template,
        )
        scores = [0.0] * len(ids)
        for batch in _batches(ids, self.config.batch_size):
            for index, value in zip(batch, self._score_batch([ids[i] for i in batch]), strict=True):
                scores[index] = value
        return scores

    def text(self, sample: Sample) -> str:
        """What the model reads for ``sample``."""
        if not self.config.chat_template:
            return render(self.config.template, sample)
        messages = [
            {"role": "user", "content": sample.prompt},
            {"role": "assistant", "content": sample.completion},
        ]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    @torch.inference_mode()
    def _score_batch(self, rows: Sequence[Sequence[int]]) -> list[float]:
        logits = self.model(**_padded(self.tokenizer, rows, self.device)).logits.float()
        if self.config.normalize == "softmax":
            values = torch.softmax(logits, dim=-1)[:, self.label]
        elif self.config.normalize == "sigmoid":
            values = torch.sigmoid(logits[:, self.label])
        else:
            values = logits[:, self.label]
        return values.cpu().tolist()


def _choose_label(config: SequenceClassifierReward.Config, num_labels: int) -> int:
    """The logit index that is the score, checked against the head's ``num_labels``."""
    path = config.model_path
    if config.label is None:
        if num_labels != 1:
            raise ValueError(
                f"the model at `{path}` has {num_labels} labels: set `label` to the index (0 to "
                f"{num_labels - 1}) of the logit that is the score"
            )
        label = 0
    elif config.label >= num_labels:
        raise ValueError(
            f"label = {config.label} is out of range: the model at `{path}` has {num_labels} "
            f"label{'s' if num_labels != 1 else ''} (0 to {num_labels - 1})"
        )
    else:
        label = config.label
    if config.normalize == "softmax" and num_labels < 2:
        raise ValueError(f"normalize = 'softmax' needs at least 2 labels; the model at `{path}` has 1")
    return label


# --- GenerativeJudge ---------------------------------------------------------------------------


class GenerativeJudge(Reward):
    """An LLM as a judge: ``template`` asks a causal LM to grade the completion; it generates
    ``max_new_tokens`` greedily and the first match of ``pattern`` in its answer is the score,
    clipped to ``[min_score, max_score]`` (and mapped to ``[0, 1]`` with ``normalize``). An
    answer without a number scores ``fallback_score``, unchanged.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        model_path: str
        # `{prompt}`, `{completion}` and any field of the data record, e.g. `{answer}`.
        template: str = DEFAULT_JUDGE_TEMPLATE
        # Send the rendered template as a user turn through the tokenizer's chat template.
        chat_template: bool = False
        add_special_tokens: bool = True
        device: str = "cpu"
        dtype: Dtype = "float32"
        batch_size: int = 8
        # Tokens of the judge's prompt at most (its start is cut off first).
        max_length: int = 1024
        max_new_tokens: int = 8
        # Its first match is the score; with a group, group 1.
        pattern: str = NUMBER
        min_score: float = 0.0
        max_score: float = 10.0
        normalize: bool = False
        fallback_score: float = 0.0
        torch_threads: int = 0

        def __post_init__(self) -> None:
            _check_common(self)
            _check_positive(self, "max_new_tokens")
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ConfigError(("pattern",), f"is not a valid regular expression: {err}") from None
            if not self.min_score < self.max_score:
                raise ConfigError(("max_score",), f"must exceed min_score ({self.min_score})")

    def __init__(self, config: GenerativeJudge.Config) -> None:
        super().__init__(config)
        _set_threads(config.torch_threads)
        self.device = _resolve_device(config.device)
        self.pattern = re.compile(config.pattern)
        self.tokenizer = _load_tokenizer(config.model_path, padding_side="left", truncation_side="left")
        if config.chat_template:
            _check_chat_template(self.tokenizer, config.model_path)
        _check_pad_token(self.tokenizer, config.batch_size, config.model_path)
        dtype = TORCH_DTYPES[config.dtype]
        self.model = _load_model(AutoModelForCausalLM, config.model_path, self.device, dtype)
        eos = self.model.generation_config.eos_token_id
        self.generation_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=config.max_new_tokens,
            eos_token_id=eos if eos is not None else self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    def score(self, samples: Sequence[Sample]) -> list[float]:
        return [self.score_answer(answer) for answer in self.answers(samples)]

    def answers(self, samples: Sequence[Sample]) -> list[str]:
        """The judge's decoded answer for each sample."""
        ids = _encode(
            self.tokenizer,
            [self.text(sample) for sample in samples],
            max_length=self.config.max_length,
            add_special_tokens=self.config.add_special_tokens and not self.config.chat_template,
        )
        answers = [""] * len(ids)
        for batch in _batches(ids, self.config.batch_size):
            for index, answer in zip(batch, self._generate([ids[i] for i in batch]), strict=True):
                answers[index] = answer
        return answers

    def text(self, sample: Sample) -> str:
        """The judge's prompt for ``sample``."""
        text = render(self.config.template, sample)
        if not self.config.chat_template:
            return text
        messages = [{"role": "user", "content": text}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def score_answer(self, answer: str) -> float:
        """The score the judge's ``answer`` gives: clipped (and normalised), or the fallback."""
        value = read_number(answer, self.pattern)
        config = self.config
        if value is None:
            return config.fallback_score
        value = min(max(value, config.min_score), config.max_score)
        if config.normalize:
            return (value - config.min_score) / (config.max_score - config.min_score)
        return value

    @torch.inference_mode()
    def _generate(self, rows: Sequence[Sequence[int]]) -> list[str]:
        inputs = _padded(self.tokenizer, rows, self.device)
        output = self.model.generate(**inputs, generation_config=self.generation_config)
        new_tokens = output[:, inputs["input_ids"].shape[1] :]
        return self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)


def read_number(text: str, pattern: re.Pattern[str]) -> float | None:
    """The first match of ``pattern`` in ``text`` (its group 1 if it has groups) as a float;
    None when nothing matches or the match is not a finite number."""
    for match in pattern.finditer(text):
        try:
            value = float(match.group(1) if pattern.groups else match.group(0))
        except (TypeError, ValueError):
            continue
        if value == value and abs(value) != float("inf"):
            return value
    return None


# --- the demo reward model ---------------------------------------------------------------------

DEMO_PROPERTY = "the completion contains the digit 7"
DEMO_MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_positions": 512}
DEMO_STEPS = 150
DEMO_BATCH = 64
DEMO_LEARNING_RATE = 3e-3
DEMO_HELD_OUT = 512


def has_demo_property(completion: str) -> bool:
    """What the demo reward model learns to prefer."""
    return "7" in completion


def demo_examples(count: int, *, seed: int) -> list[tuple[str, str, bool]]:
    """``(prompt, completion, positive)``: half the completions contain a 7 (after the prompt,
    which may contain 7s too); completions are digit strings or random characters."""
    rng = random.Random(seed)
    questions = [r["question"] for r in addition_records(100, seed=seed, digits=1)]
    questions += [r["question"] for r in addition_records(2000, seed=seed + 1, digits=2)]
    characters = [c for c in DEFAULT_ALPHABET if c != "7"]
    digits = [c for c in string.digits if c != "7"]
    examples = []
    for index in range(count):
        positive = index % 2 == 0
        pool = digits if rng.random() < 0.5 else characters
        chars = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
        if positive:
            for _ in range(rng.choice((1, 1, 1, 2, 3))):
                chars.insert(rng.randint(0, len(chars)), "7")
        examples.append((rng.choice(questions), "".join(chars), positive))
    rng.shuffle(examples)
    return examples


def create_demo_reward_model(
    directory: str | Path, *, steps: int = DEMO_STEPS, seed: int = 0
) -> dict[str, Any]:
    """Train and save (safetensors) a tiny ``LlamaForSequenceClassification`` with the quickstart's
    character tokenizer whose one logit says whether ``{prompt}{completion}`` has a 7 in the
    completion. Seeded. Returns its held-out accuracy and mean sigmoid scores, also saved as
    ``demo.json`` next to the model."""
    directory = Path(directory)
    tokenizer = create_char_tokenizer(directory)
    threads = torch.get_num_threads()
    # One thread: as fast for a model this small, and not slowed down by a busy machine.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForSequenceClassification(_demo_config(tokenizer))
            _train_demo(model, tokenizer, demo_examples(steps * DEMO_BATCH, seed=seed), steps)
        model.eval()
        held_out = _evaluate_demo(model, tokenizer, demo_examples(DEMO_HELD_OUT, seed=seed + 1000))
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(directory))
    facts = {
        "prefers": DEMO_PROPERTY,
        "template": "{prompt}{completion}",
        "seed": seed,
        "steps": steps,
        "parameters": sum(p.numel() for p in model.parameters()),
        "held_out": held_out,
    }
    (directory / "demo.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def _demo_config(tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    size = DEMO_MODEL["hidden_size"]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size,
        intermediate_size=4 * size,
        num_hidden_layers=DEMO_MODEL["num_layers"],
        num_attention_heads=DEMO_MODEL["num_heads"],
        num_key_value_heads=DEMO_MODEL["num_heads"],
        max_position_embeddings=DEMO_MODEL["max_positions"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        num_labels=1,
        id2label={0: "has_7"},
        label2id={"has_7": 0},
    )


def _demo_batch(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[tuple[str, str, bool]]
) -> tuple[Mapping[str, torch.Tensor], torch.Tensor]:
    inputs = tokenizer([p + c for p, c, _ in examples], padding=True, return_tensors="pt")
    return inputs, torch.tensor([float(positive) for _, _, positive in examples])


def _train_demo(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[tuple[str, str, bool]],
    steps: int,
) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEMO_LEARNING_RATE)
    model.train()
    for step in range(steps):
        inputs, targets = _demo_batch(tokenizer, examples[step * DEMO_BATCH : (step + 1) * DEMO_BATCH])
        logits = model(**inputs).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@torch.inference_mode()
def _evaluate_demo(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[tuple[str, str, bool]]
) -> dict[str, float]:
    inputs, targets = _demo_batch(tokenizer, examples)
    logits = model(**inputs).logits[:, 0]
    scores = torch.sigmoid(logits)
    positive = targets == 1
    return {
        "accuracy": round(((logits > 0) == positive).float().mean().item(), 4),
        "mean_score_positive": round(scores[positive].mean().item(), 4),
        "mean_score_negative": round(scores[~positive].mean().item(), 4),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m python_plugins.reward_models", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("create-demo", help=f"train a tiny reward model that prefers: {DEMO_PROPERTY}")
    demo.add_argument("directory", help="where to write the model (config, safetensors, tokenizer)")
    demo.add_argument("--steps", type=int, default=DEMO_STEPS, help="training steps (batches of 64)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--force", action="store_true", help="overwrite a model that already exists")
    args = parser.parse_args(argv)
    transformers_logging.disable_progress_bar()
    target = Path(args.directory)
    if (target / "model.safetensors").exists() and not args.force:
        print(f"{target}: kept (exists; --force rewrites)")
        return 0
    started = time.monotonic()
    facts = create_demo_reward_model(target, steps=args.steps, seed=args.seed)
    held_out = facts["held_out"]
    print(f"wrote {target} ({facts['parameters']:,} parameters, {time.monotonic() - started:.1f} s)")
    print(
        f"prefers: {DEMO_PROPERTY}; held-out accuracy {held_out['accuracy']:.3f}, mean score "
        f"{held_out['mean_score_positive']:.3f} (with a 7) vs {held_out['mean_score_negative']:.3f} (without)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
