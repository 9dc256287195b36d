"""Hugging Face TRL's ``GRPOTrainer`` doing Rollout's GRPO step, timed per optimizer step.

The TRL side of ``bench/e2e_vs_trl``, run by it as a subprocess. Each optimizer step samples
``--completions-per-step`` fresh completions (prompts x ``--num-generations``), scores them
with Rollout's own ``python_plugins.rewards:ExactMatch``, normalises rewards within each group
(``(r - mean) / (std + 1e-4)``, unbiased std), and takes exactly one AdamW step on the
clipped token-level objective (epsilon 0.2 both sides) summed over every completion token of
the step and divided by their count, plus ``beta`` times the k3 KL to the frozen starting
model. No generation is reused across steps.

Writes ``--out`` (JSONL): one line per optimizer step with ``step_seconds`` (whole step, from
fetching the step's prompts to the end of its logging, generation included) split into
``generate_seconds`` (``_generate``: tokenising prompts, ``model.generate``, decoding),
``reward_seconds`` (``_calculate_rewards``), ``logprob_seconds`` (reference log-probability
passes made while scoring the batch), ``train_seconds`` (loss forward + backward, gradient
clipping and the optimizer step), ``sync_seconds`` (0: without vLLM there is no weight sync)
and ``other_seconds`` (the rest: padding, advantages, TRL's metrics, data loading, logging);
then one ``{"summary": true, ...}`` line with the configuration.

Speed options measured on this 2-core CPU (2 torch threads, 64 completions of at most 32
tokens per step, median seconds of steps 4-13 from the warm-started models;
``bench/trl_grpo.py --help`` lists the flags):

- generation: ``model.generate`` on the step's whole batch (the default) against transformers'
  continuous batching (``--generation continuous_batching``, KV cache sized to one step):
  tiny 0.078 s against 0.62 s, small 0.93 s against 1.48 s per step;
- micro-batch: the whole step in one forward/backward (the default) against 16 rows with
  gradient accumulation: tiny 0.078 s against 0.089 s, small 0.93 s against 0.95 s;
- optimizer: ``adamw_torch_fused`` (the default) takes 11 ms per step on the small model
  against 28-57 ms for ``adamw_torch``'s for-each and per-tensor paths;
- ``--cache-implementation static`` for ``generate``: tiny 0.082 s against 0.071 s, small
  0.86 s against 0.82 s per step, so the default dynamic cache stays;
- vLLM generation and Liger kernels are TRL's other speed options; both need a GPU;
- ``--torch-compile``: the first two steps take about 25 s each (compiling, then compiling
  again for dynamic shapes) and later steps the same 0.076-0.079 s as without it on the
  tiny model, so it is left off.
"""

from __future__ import annotations

import os

# Nothing here needs the network: keep TRL's telemetry ping and hub lookups out of the timings.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
import transformers
import trl
from datasets import Dataset
from transformers import (
    AutoTokenizer,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.utils import logging as transformers_logging
from trl import GRPOConfig, GRPOTrainer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rollout_sdk  # noqa: E402

PHASES = ("generate", "reward", "logprob", "train", "sync")


class StepClock:
    """Seconds spent in each phase during the current optimizer step, plus its token counts."""

    def __init__(self) -> None:
        self.step_started: float | None = None
        self.cpu_started = 0.0
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(
            ("generate", "reward", "logprob", "prepare", "training_step", "forward", "optimizer"), 0.0
        )
        self.completions = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.stopped = 0
        self.rewards: list[float] = []
        self.optimizer_started: float | None = None

    def add(self, phase: str, started: float) -> None:
        self.seconds[phase] += time.perf_counter() - started


class OptimizerTimer(TrainerCallback):
    """Times ``optimizer.step()``: the Trainer calls these two hooks right around it."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.clock.optimizer_started = time.perf_counter()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.clock.optimizer_started is not None:
            self.clock.add("optimizer", self.clock.optimizer_started)
            self.clock.optimizer_started = None


class TimedGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` unchanged except for timers around its phases and one JSON line per step."""

    def setup_timing(self, clock: StepClock, out: TextIO) -> None:
        self.clock = clock
        self.out = out
        self.scoring = False
        self.step_logs: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []
        self.train_started = time.perf_counter()
        self.add_callback(OptimizerTimer(clock))

    # The step starts when the Trainer fetches its batches, before `on_step_begin`.
    def get_batch_samples(self, *args: Any, **kwargs: Any) -> Any:
        self.clock.reset()
        self.clock.step_started = time.perf_counter()
        self.clock.cpu_started = time.process_time()
        return super().get_batch_samples(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self.clock.add("training_step", started)

    def _prepare_inputs(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return super()._prepare_inputs(*args, **kwargs)
        finally:
            self.clock.add("prepare", started)

    def _generate_and_score_completions(self, *args: Any, **kwargs: Any) -> Any:
        self.scoring = True
        try:
            return super()._generate_and_score_completions(*args, **kwargs)
        finally:
            self.scoring = False

    def _generate(self, prompts: list) -> Any:
        started = time.perf_counter()
        result = super()._generate(prompts)
        self.clock.add("generate", started)
        prompt_ids, completion_ids = result[0], result[1]
        eos = set(self.eos_token_ids)
        self.clock.completions += len(completion_ids)
        self.clock.generated_tokens += sum(len(ids) for ids in completion_ids)
        self.clock.prompt_tokens += sum(len(ids) for ids in prompt_ids)
        self.clock.stopped += sum(1 for ids in completion_ids if ids and ids[-1] in eos)
        return result

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return super()._calculate_rewards(*args, **kwargs)
        finally:
            self.clock.add("reward", started)

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        finally:
            self.clock.add("logprob" if self.scoring else "forward", started)

    def _clip_grad_norm(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return super()._clip_grad_norm(*args, **kwargs)
        finally:
            self.clock.add("optimizer", started)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)  # merges TRL's metrics (reward, kl, entropy, ...) into `logs`
        if "loss" in logs:
            self.step_logs = dict(logs)

    # Called right after `on_step_end`: it logs (and would evaluate or save; both are off).
    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)
        if self.clock.step_started is not None:
            self.finish_step()

    def finish_step(self) -> None:
        clock = self.clock
        step_seconds = time.perf_counter() - clock.step_started
        cpu_seconds = time.process_time() - clock.cpu_started
        clock.step_started = None
        seconds = clock.seconds
        phases = {
            "generate": seconds["generate"],
            "reward": seconds["reward"],
            "logprob": seconds["logprob"],
            # Loss forward + backward (each micro-batch's training_step minus the generation and
            # scoring done inside its `_prepare_inputs`), gradient clipping and the AdamW step.
            "train": seconds["training_step"] - seconds["prepare"] + seconds["optimizer"],
            "sync": 0.0,
        }
        logs = self.step_logs
        record: dict[str, Any] = {
            "step": self.state.global_step,
            "reward_mean": statistics.fmean(clock.rewards) if clock.rewards else None,
            "completions": clock.completions,
            "generated_tokens": clock.generated_tokens,
            "prompt_tokens": clock.prompt_tokens,
            "stopped_completions": clock.stopped,
            "step_seconds": step_seconds,
            **{f"{name}_seconds": value for name, value in phases.items()},
            "other_seconds": step_seconds - sum(phases.values()),
            # Since `train()` was called: consecutive differences are the whole loop per step.
            "elapsed_seconds": time.perf_counter() - self.train_started,
            # Parts of train_seconds: the loss's forward pass(es) and clipping + optimizer step.
            "train_forward_seconds": seconds["forward"],
            "train_optimizer_seconds": seconds["optimizer"],
            # CPU time of this process over the step: about threads x step_seconds when the
            # machine is otherwise idle, less when something else competes for the cores.
            "process_cpu_seconds": cpu_seconds,
            "loss": logs.get("loss"),
            "grad_norm": logs.get("grad_norm"),
            "entropy": logs.get("entropy"),
            "trl_reward": logs.get("reward"),
            "clip_ratio": logs.get("clip_ratio/region_mean"),
        }
        if self.beta != 0.0:
            record["kl"] = logs.get("kl")
        self.step_logs = {}
        self.records.append(record)
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()


def make_reward(clock: StepClock, eos_ids: Sequence[int]) -> Any:
    """A TRL reward function scoring with Rollout's ``ExactMatch`` (the same class, same samples)."""
    exact_match = rollout_sdk.load_plugin("python_plugins.rewards:ExactMatch", {})
    eos = set(eos_ids)

    def exact_match_reward(
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        record_json: list[str],
        **kwargs: Any,
    ) -> list[float]:
        samples = [
            rollout_sdk.Sample(
                prompt=prompt,
                completion=completion,
                record=json.loads(record),
                finish_reason="stop" if ids and ids[-1] in eos else "length",
            )
            for prompt, completion, ids, record in zip(
                prompts, completions, completion_ids, record_json, strict=True
            )
        ]
        scores = [float(score) for score in exact_match.score(samples)]
        clock.rewards.extend(scores)
        return scores

    return exact_match_reward


def load_dataset(path: Path, template: str) -> Dataset:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"{path} has no records")
    return Dataset.from_dict(
        {
            "prompt": [template.format(**record) for record in records],
            "record_json": [json.dumps(record) for record in records],
        }
    )


def build_config(args: argparse.Namespace, output_dir: str) -> GRPOConfig:
    per_step = args.completions_per_step
    if per_step % args.num_generations:
        raise SystemExit("--completions-per-step must be a multiple of --num-generations")
    micro = args.micro_batch or per_step
    if per_step % micro:
        raise SystemExit("--micro-batch must divide --completions-per-step")
    accumulation = per_step // micro
    bf16 = args.precision == "bf16"
    weights_dtype = "bfloat16" if bf16 and args.bf16_weights else "float32"
    return GRPOConfig(
        output_dir=output_dir,
        # One optimizer step per `per_step` fresh completions: the generation batch is the
        # accumulated batch (steps_per_generation defaults to gradient_accumulation_steps), it
        # is used once (num_iterations=1), so old log-probs are the detached current ones.
        max_steps=args.steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        num_generations=args.num_generations,
        num_iterations=1,
        max_completion_length=args.max_completion_length,
        # Loss: clipped token-level ratio objective summed over all completion tokens of the
        # step / their count ("dapo"), group-normalised advantages with the unbiased std.
        loss_type="dapo",
        scale_rewards="group",
        importance_sampling_level="token",
        epsilon=0.2,
        epsilon_high=0.2,
        beta=args.beta,
        # TRL's default multiplies the k3 term by the (differentiable, value-1) ratio, which
        # changes its gradient; Rollout adds the plain k3 estimator.
        use_bias_correction_kl=False,
        mask_truncated_completions=False,
        # Sampling
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        use_transformers_continuous_batching=args.generation == "continuous_batching",
        transformers_continuous_batching_config=args.cb_config,
        cache_implementation=args.cache_implementation,
        # Optimizer: AdamW, constant learning rate, no warm-up, gradient norm clipped to 1.
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim=args.optim,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        # Model and precision
        model_init_kwargs={"dtype": weights_dtype},
        bf16=bf16,
        fp16=False,
        disable_dropout=True,
        gradient_checkpointing=False,
        torch_compile=args.torch_compile,
        use_cpu=True,
        # Data order, seeds, no logging integrations, no checkpoints, log every step
        seed=args.seed,
        data_seed=args.seed,
        shuffle_dataset=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        log_completions=False,
    )


def step_sized_cache(args: argparse.Namespace, tokenizer: Any, prompts: list[str]) -> dict[str, int]:
    """A continuous-batching KV cache holding one step's sequences, prefilled in one pass.

    Left to itself, transformers sizes the cache from the device's free memory, which on a CPU
    is a large share of RAM, and each step then allocates it and reads it.
    """
    block_size = 32
    longest_prompt = max(len(ids) for ids in tokenizer(prompts)["input_ids"])
    blocks_per_sequence = -(-(longest_prompt + args.max_completion_length) // block_size)
    return {
        "block_size": block_size,
        "num_blocks": args.completions_per_step * blocks_per_sequence,
        "max_batch_tokens": max(256, args.completions_per_step * longest_prompt),
    }


CONFIG_FIELDS = (
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "generation_batch_size",
    "steps_per_generation",
    "num_generations",
    "num_iterations",
    "max_completion_length",
    "loss_type",
    "scale_rewards",
    "importance_sampling_level",
    "epsilon",
    "epsilon_high",
    "beta",
    "use_bias_correction_kl",
    "temperature",
    "top_p",
    "top_k",
    "use_transformers_continuous_batching",
    "transformers_continuous_batching_config",
    "cache_implementation",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "optim",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "weight_decay",
    "max_grad_norm",
    "model_init_kwargs",
    "bf16",
    "disable_dropout",
    "gradient_checkpointing",
    "torch_compile",
    "use_cpu",
    "seed",
    "shuffle_dataset",
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, type=Path, help="local HF model directory")
    parser.add_argument("--data", required=True, type=Path, help="JSONL records, e.g. question/answer")
    parser.add_argument("--template", default="{question}", help="prompt = template.format(**record)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient; 0: no reference model")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--completions-per-step", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", required=True, type=Path, help="JSONL, one line per optimizer step")
    speed = parser.add_argument_group("TRL speed options (defaults: the fastest measured on CPU)")
    speed.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="per_device_train_batch_size; gradients are accumulated over the step (0: the whole step)",
    )
    speed.add_argument(
        "--generation",
        choices=("generate", "continuous_batching"),
        default="generate",
        help="model.generate on the step's batch, or use_transformers_continuous_batching",
    )
    speed.add_argument(
        "--cb-config",
        type=json.loads,
        default=None,
        help="JSON for transformers' ContinuousBatchingConfig (default: a KV cache sized to one step)",
    )
    speed.add_argument("--cache-implementation", default=None, help="GRPOConfig.cache_implementation")
    speed.add_argument("--optim", default="adamw_torch_fused", choices=("adamw_torch_fused", "adamw_torch"))
    speed.add_argument("--torch-compile", action="store_true", help="GRPOConfig.torch_compile")
    speed.add_argument(
        "--bf16-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --precision bf16: load the weights in bfloat16 (as Rollout's dtype=bfloat16 does) "
        "rather than keep fp32 weights under bf16 autocast",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    dataset = load_dataset(args.data, args.template)
    if args.generation == "continuous_batching" and args.cb_config is None:
        args.cb_config = step_sized_cache(args, tokenizer, list(dataset["prompt"]))
    output_dir = tempfile.mkdtemp(prefix="trl-grpo-")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with args.out.open("w") as out:
            config = build_config(args, output_dir)
            clock = StepClock()
            trainer = TimedGRPOTrainer(
                model=str(args.model),
                reward_funcs=[make_reward(clock, [tokenizer.eos_token_id])],
                args=config,
                train_dataset=dataset,
                processing_class=tokenizer,
            )
            trainer.remove_callback(PrinterCallback)
            trainer.remove_callback(ProgressCallback)
            trainer.setup_timing(clock, out)
            setup_seconds = time.perf_counter() - started
            trained = time.perf_counter()
            trainer.train_started = trained
            trainer.train()
            train_seconds = time.perf_counter() - trained
            parameters = sum(p.numel() for p in trainer.model.parameters())
            summary = {
                "summary": True,
                "framework": "trl",
                "trl_version": trl.__version__,
                "transformers_version": transformers.__version__,
                "torch_version": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "parameters": parameters,
                "model_dtype": str(trainer.model.dtype).removeprefix("torch."),
                "eos_token_ids": list(trainer.eos_token_ids),
                "steps": len(trainer.records),
                "setup_seconds": setup_seconds,
                "train_seconds_total": train_seconds,
                "config": {name: getattr(config, name) for name in CONFIG_FIELDS},
            }
            out.write(json.dumps(summary, default=str) + "\n")
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
