"""The workload, the two frameworks' runs of it, and their per-step records in one shape."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.e2e import REPO
from bench.e2e.flops import step_model_flops, training_flops
from bench.e2e.processes import run_measured

PHASES = ("generate", "reward", "logprob", "train", "sync", "other")


@dataclasses.dataclass(frozen=True)
class ModelSize:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    # The supervised warm start: enough for a first foothold on exact-match addition.
    sft_steps: int
    sft_learning_rate: float

    def create(self, path: Path, seed: int) -> None:
        """A randomly initialised Llama of this size, saved (with the tokenizer) under ``path``."""
        from python_plugins.quickstart import create_tiny_model

        create_tiny_model(
            path,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            seed=seed,
        )


SIZES = {
    "tiny": ModelSize("tiny", 128, 4, 4, 512, sft_steps=600, sft_learning_rate=1e-3),
    "small": ModelSize("small", 512, 8, 8, 1376, sft_steps=400, sft_learning_rate=3e-4),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """What both frameworks are asked to do, identically."""

    prompts_per_step: int = 8
    group_size: int = 8
    max_completion_length: int = 32
    learning_rate: float = 5e-5
    threads: int = 2
    seed: int = 0

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + " }"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(value)


def write_toml(path: Path, tables: Mapping[str, Mapping[str, Any]]) -> None:
    lines = []
    for table, values in tables.items():
        header = f"[[{table[2:]}]]" if table.startswith("[]") else f"[{table}]"
        lines.append(header)
        lines.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def policy_options(model: Path, workload: Workload, precision: str, overlap: bool = False) -> dict[str, Any]:
    # Overlapped, each copy of the policy (training, generation) gets half the threads.
    threads = max(1, workload.threads // 2) if overlap else workload.threads
    return {
        "model_path": str(model),
        "torch_threads": threads,
        "dtype": "bfloat16" if precision == "bf16" else "float32",
    }


def warm_start(rollout: Path, work: Path, size: ModelSize, data: Path, workload: Workload) -> Path:
    """A randomly initialised model of ``size`` trained briefly with SFT; its checkpoint's model dir."""
    init = work / f"{size.name}-init"
    run_dir = work / f"{size.name}-warm-start"
    model = run_dir / "checkpoints" / "step-00000000" / "policy" / "model"
    if (model / "model.safetensors").exists():
        return model
    size.create(init, seed=workload.seed)
    config = work / f"{size.name}-warm-start.toml"
    write_toml(
        config,
        {
            "run": {"name": f"warm-start-{size.name}", "output_dir": str(run_dir), "seed": 0, "steps": 0},
            "policy": {
                "plugin": "python_plugins.hf_policy:HFCausalLM",
                "options": policy_options(init, workload, "fp32"),
            },
            "data": {
                "plugin": "python_plugins.data:JsonlPrompts",
                "options": {"path": str(data), "template": "{question}"},
            },
            "[]rewards": {"plugin": "python_plugins.rewards:ExactMatch"},
            "sft": {"steps": size.sft_steps, "batch_size": 64, "learning_rate": size.sft_learning_rate},
        },
    )
    print(f"  warm-starting the {size.name} model ({size.sft_steps} SFT steps)", flush=True)
    run_measured(
        [str(rollout), "run", str(config), "--overwrite"], work / "logs" / f"{size.name}-warm-start.log"
    )
    return model


@dataclasses.dataclass(frozen=True)
class RunSpec:
    framework: str
    size: str
    model: Path
    kl_coef: float
    precision: str
    steps: int
    label: str
    # Rollout only: generation overlaps training (`cluster.max_staleness = 1`).
    overlap: bool = False


def rollout_command(
    spec: RunSpec, rollout: Path, work: Path, data: Path, workload: Workload
) -> tuple[list[str], Path]:
    run_dir = work / "runs" / spec.label
    config = work / "configs" / f"{spec.label}.toml"
    overlap = {"cluster": {"max_staleness": 1}} if spec.overlap else {}
    write_toml(
        config,
        {
            "run": {
                "name": spec.label,
                "output_dir": str(run_dir),
                "seed": workload.seed,
                "steps": spec.steps,
            },
            "policy": {
                "plugin": "python_plugins.hf_policy:HFCausalLM",
                "options": policy_options(spec.model, workload, spec.precision, spec.overlap),
            },
            "data": {
                "plugin": "python_plugins.data:JsonlPrompts",
                "options": {"path": str(data), "template": "{question}"},
            },
            "[]rewards": {"plugin": "python_plugins.rewards:ExactMatch"},
            "rollout": {
                "prompts_per_step": workload.prompts_per_step,
                "group_size": workload.group_size,
                "max_new_tokens": workload.max_completion_length,
                "temperature": 1.0,
            },
            "algorithm": {"advantage": "group_norm", "kl_coef": spec.kl_coef},
            "train": {"learning_rate": workload.learning_rate},
            # Only the final checkpoint, as TRL saves none: neither run is timed writing files.
            "checkpoint": {"every": 0, "keep": 1},
            **overlap,
        },
    )
    return [str(rollout), "run", str(config), "--overwrite"], run_dir / "metrics.jsonl"


def trl_command(
    spec: RunSpec, python: Path, work: Path, data: Path, workload: Workload
) -> tuple[list[str], Path]:
    out = work / "runs" / f"{spec.label}.jsonl"
    command = [
        str(python),
        str(REPO / "bench" / "trl_grpo.py"),
        "--model", str(spec.model),
        "--data", str(data),
        "--steps", str(spec.steps),
        "--learning-rate", str(workload.learning_rate),
        "--beta", str(spec.kl_coef),
        "--threads", str(workload.threads),
        "--seed", str(workload.seed),
        "--precision", spec.precision,
        "--max-completion-length", str(workload.max_completion_length),
        "--num-generations", str(workload.group_size),
        "--completions-per-step", str(workload.completions_per_step),
        "--out", str(out),
    ]  # fmt: skip
    return command, out


def read_steps(framework: str, path: Path) -> list[dict[str, float]]:
    """Per-step records in one shape: completions, tokens, seconds by phase, reward.

    A step's seconds are the wall time between the ends of consecutive steps, so whatever a
    framework does between steps (logging, callbacks) counts as its ``other`` phase.
    """
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = []
    previous_elapsed = 0.0
    for record in records:
        if record.get("summary"):
            continue
        # The whole loop from the previous step's end to this one's: logging and callbacks too.
        wall = record["elapsed_seconds"] - previous_elapsed
        previous_elapsed = record["elapsed_seconds"]
        if framework == "rollout":
            reference = record.get("reference_seconds", 0.0)
            phases = {
                "generate": record["generate_seconds"],
                "reward": record["score_seconds"],
                "logprob": reference,
                "train": record["train_seconds"] - reference,
                "sync": 0.0,
            }
            sequence_tokens = record["sequence_tokens"]
        else:
            phases = {name: record[f"{name}_seconds"] for name in PHASES if name != "other"}
            sequence_tokens = record["prompt_tokens"] + record["generated_tokens"]
        # Overlapped generation and training can sum past the step.
        phases["other"] = max(0.0, wall - sum(phases.values()))
        steps.append(
            {
                "step": record["step"],
                "completions": record["completions"],
                "generated_tokens": record["generated_tokens"],
                "sequence_tokens": sequence_tokens,
                "step_seconds": wall,
                "reward_mean": record["reward_mean"],
                **{f"{name}_seconds": value for name, value in phases.items()},
            }
        )
    return steps


def summarise(
    steps: Sequence[Mapping[str, float]],
    warmup: int,
    model_config: Mapping[str, Any],
    kl: bool,
    gemm_gflops: float,
) -> dict[str, Any]:
    """Medians over the steps after ``warmup``."""
    measured = steps[warmup:]
    if len(measured) < 1:
        raise SystemExit(f"no steps left after {warmup} warm-up steps")

    def median(values: Iterable[float]) -> float:
        return statistics.median(list(values))

    flops = [step_model_flops(model_config, step, kl) for step in measured]
    return {
        "measured_steps": len(measured),
        "completions_per_second": median(s["completions"] / s["step_seconds"] for s in measured),
        "generated_tokens_per_second": median(s["generated_tokens"] / s["step_seconds"] for s in measured),
        "step_seconds": median(s["step_seconds"] for s in measured),
        "phase_seconds": {name: median(s[f"{name}_seconds"] for s in measured) for name in PHASES},
        "completion_length_mean": median(s["generated_tokens"] / s["completions"] for s in measured),
        "model_gflops_per_step": median(flops) / 1e9,
        # Seconds the step's model FLOPs take at the measured GEMM rate, over the step's seconds.
        "compute_bound_fraction": median(
            f / (gemm_gflops * 1e9) / s["step_seconds"] for f, s in zip(flops, measured, strict=True)
        ),
        # The same for the training phase alone: its forward + backward FLOPs over its seconds.
        "train_compute_bound_fraction": median(
            training_flops(model_config, s) / (gemm_gflops * 1e9) / s["train_seconds"] for s in measured
        ),
        "reward_mean": statistics.fmean(s["reward_mean"] for s in steps),
    }
