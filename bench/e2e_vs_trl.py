"""End-to-end GRPO, Rollout against Hugging Face TRL's ``GRPOTrainer``, on the same work.

Run with ``bench/e2e_vs_trl``. For each model size (a ~1M-parameter "tiny" and a ~25M-parameter
"small" Llama, both created here and warm-started by a short supervised run so that the
exact-match reward is not 0) it runs Rollout and TRL one after the other, alternating which
goes first, with and without a KL term, and measures completions and generated tokens per
second, seconds per step by phase and the peak resident memory of each process tree. It also
measures the machine's fp32 matrix-multiply rate at the model's shapes and its memory-copy
bandwidth, and from the model's FLOPs per token the share of that compute bound each framework
achieves. A longer run from the same checkpoint compares the reward curves.

Writes ``bench/results/e2e_vs_trl.json``, ``docs/e2e_vs_trl_learning.png`` and the tables in
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "bench" / "results" / "e2e_vs_trl.json"
DOCS = REPO / "docs" / "benchmarks.md"
PLOT = REPO / "docs" / "e2e_vs_trl_learning.png"
BEGIN, END = "<!-- e2e:begin -->", "<!-- e2e:end -->"
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


# Model FLOPs


def matmul_shapes(config: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(in, out) of every weight matrix a token passes through: each layer's, then the head's."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    layer = [
        (hidden, heads * head_dim),
        (hidden, kv * head_dim),
        (hidden, kv * head_dim),
        (heads * head_dim, hidden),
        (hidden, inter),
        (hidden, inter),
        (inter, hidden),
    ]
    return layer * config["num_hidden_layers"] + [(hidden, config["vocab_size"])]


def forward_flops_per_token(config: Mapping[str, Any], context: float) -> float:
    """Multiply-adds x 2 of one token's forward pass: the matrices, plus attention over ``context`` keys."""
    matrices = sum(2 * n_in * n_out for n_in, n_out in matmul_shapes(config))
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    attention = 2 * 2 * config["num_hidden_layers"] * heads * head_dim * context
    return matrices + attention


def step_model_flops(config: Mapping[str, Any], record: Mapping[str, float], kl: bool) -> float:
    """The FLOPs a GRPO step needs, counted the same way for both frameworks (as for MFU).

    Generation: one forward per prompt token of every sample and per generated token; training:
    forward + backward (3x) over every sampled sequence; with a KL term, one reference forward
    over every sequence. Work a framework avoids (shared prompt prefixes, rows without a
    learning signal) is still counted, so a framework that skips it scores higher.
    """
    completions = record["completions"]
    sequence_tokens = record["sequence_tokens"]
    context = sequence_tokens / max(completions, 1) / 2
    per_token = forward_flops_per_token(config, context)
    generation = per_token * sequence_tokens
    training = 3 * per_token * sequence_tokens
    reference = per_token * sequence_tokens if kl else 0.0
    return generation + training + reference


# Machine limits


def machine_limits(config: Mapping[str, Any], rows: int, threads: int) -> dict[str, Any]:
    """fp32 GEMM rate at the model's shapes (``rows`` tokens at once) and memory-copy bandwidth."""
    import torch

    torch.set_num_threads(threads)
    shapes = sorted(set(matmul_shapes(config)))
    total_flops = 0.0
    total_seconds = 0.0
    per_shape = {}
    for n_in, n_out in shapes:
        a = torch.randn(rows, n_in)
        b = torch.randn(n_in, n_out)
        seconds = _best_time(lambda a=a, b=b: torch.mm(a, b), min_seconds=0.3)
        flops = 2.0 * rows * n_in * n_out
        count = matmul_shapes(config).count((n_in, n_out))
        total_flops += flops * count
        total_seconds += seconds * count
        per_shape[f"{rows}x{n_in}x{n_out}"] = flops / seconds / 1e9
    source = torch.empty(256 * 1024 * 1024 // 4).normal_()
    target = torch.empty_like(source)
    copy_seconds = _best_time(lambda: target.copy_(source), min_seconds=0.5)
    return {
        "gemm_rows": rows,
        "gemm_gflops_per_shape": per_shape,
        # Weighted by how often each shape occurs in a forward pass: the model's compute bound.
        "gemm_gflops": total_flops / total_seconds / 1e9,
        # Bytes read plus bytes written per second.
        "copy_gbytes_per_second": 2 * source.numel() * 4 / copy_seconds / 1e9,
    }


def _best_time(function: Callable[[], Any], min_seconds: float) -> float:
    for _ in range(3):
        function()
    best = float("inf")
    deadline = time.perf_counter() + min_seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


# Processes


def run_measured(command: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``command`` to completion; its wall time and the peak resident memory of its process tree.

    The peak is the larger of the polled sum over the tree and the largest per-process
    high-water mark (``VmHWM``, kept by the kernel since ``exec``). ``ru_maxrss`` from ``wait4``
    would not do: Linux carries the parent's peak into a child it forks.
    """
    import psutil

    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        peak = 0
        stop = threading.Event()

        def poll() -> None:
            nonlocal peak
            root = psutil.Process(process.pid)
            while not stop.is_set():
                try:
                    tree = [root, *root.children(recursive=True)]
                except psutil.Error:
                    break
                current = [_rss_and_high_water(p.pid) for p in tree]
                peak = max(peak, sum(rss for rss, _ in current), *(hwm for _, hwm in current))
                stop.wait(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        process.wait()
        stop.set()
        poller.join()
    wall = time.perf_counter() - started
    if process.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"{' '.join(map(str, command))} failed ({process.returncode}); {log}:\n{tail}")
    return {"wall_seconds": wall, "peak_rss_bytes": peak}


def _rss_and_high_water(pid: int) -> tuple[int, int]:
    """``VmRSS`` and ``VmHWM`` of a process in bytes; zeros once it is gone."""
    values = {"VmRSS:": 0, "VmHWM:": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            fields = line.split()
            if fields and fields[0] in values:
                values[fields[0]] = int(fields[1]) * 1024
    except (OSError, ValueError):
        pass
    return values["VmRSS:"], values["VmHWM:"]


# Rollout and TRL runs


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


def policy_options(model: Path, workload: Workload, precision: str) -> dict[str, Any]:
    return {
        "model_path": str(model),
        "torch_threads": workload.threads,
        "dtype": "bfloat16" if precision == "bf16" else "float32",
    }


def warm_start(rollout: Path, work: Path, size: ModelSize, data: Path, workload: Workload) -> Path:
    """A randomly initialised model of ``size`` trained briefly with SFT; its checkpoint's model dir."""
    from python_plugins.quickstart import create_tiny_model

    init = work / f"{size.name}-init"
    run_dir = work / f"{size.name}-warm-start"
    model = run_dir / "checkpoints" / "step-00000000" / "policy" / "model"
    if (model / "model.safetensors").exists():
        return model
    create_tiny_model(
        init,
        hidden_size=size.hidden_size,
        num_layers=size.num_layers,
        num_heads=size.num_heads,
        intermediate_size=size.intermediate_size,
        seed=workload.seed,
    )
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


def rollout_command(
    spec: RunSpec, rollout: Path, work: Path, data: Path, workload: Workload
) -> tuple[list[str], Path]:
    run_dir = work / "runs" / spec.label
    config = work / "configs" / f"{spec.label}.toml"
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
                "options": policy_options(spec.model, workload, spec.precision),
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
        phases["other"] = wall - sum(phases.values())
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
        "reward_mean": statistics.fmean(s["reward_mean"] for s in steps),
    }


# Reporting


def learning_verdict(rollout: Sequence[float], trl: Sequence[float]) -> dict[str, Any]:
    """Mean step reward over the second half of each run; Rollout is "not worse" unless it
    trails TRL by more than two standard errors of the difference (step rewards are noisy:
    each step sees different prompts)."""

    def half(values: Sequence[float]) -> list[float]:
        return list(values[len(values) // 2 :])

    late_rollout, late_trl = half(rollout), half(trl)
    standard_error = (
        statistics.variance(late_rollout) / len(late_rollout) + statistics.variance(late_trl) / len(late_trl)
    ) ** 0.5
    difference = statistics.fmean(late_rollout) - statistics.fmean(late_trl)
    return {
        "second_half_reward": {"rollout": statistics.fmean(late_rollout), "trl": statistics.fmean(late_trl)},
        "difference": difference,
        "standard_error": standard_error,
        "not_worse": difference >= -2 * standard_error,
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def pair_ratios(rollout: Mapping[str, Any], trl: Mapping[str, Any]) -> dict[str, float]:
    ratios = {
        "throughput_ratio": ratio(rollout["completions_per_second"], trl["completions_per_second"]),
        "generated_tokens_ratio": ratio(
            rollout["generated_tokens_per_second"], trl["generated_tokens_per_second"]
        ),
        "memory_ratio": ratio(rollout["peak_rss_bytes"], trl["peak_rss_bytes"]),
        "step_seconds_ratio": ratio(rollout["step_seconds"], trl["step_seconds"]),
    }
    for name in PHASES:
        ratios[f"{name}_seconds_ratio"] = ratio(rollout["phase_seconds"][name], trl["phase_seconds"][name])
    return ratios


def headline(pairs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per framework the median over repeats, and the median of the per-repeat ratios."""
    result: dict[str, Any] = {}
    for key in (
        "completions_per_second",
        "generated_tokens_per_second",
        "peak_rss_bytes",
        "compute_bound_fraction",
    ):
        result[key] = {fw: statistics.median(p[fw][key] for p in pairs) for fw in ("rollout", "trl")}
    for key in ("throughput_ratio", "memory_ratio", "generated_tokens_ratio"):
        result[key] = statistics.median(p["ratios"][key] for p in pairs)
        result[f"{key}_per_repeat"] = [p["ratios"][key] for p in pairs]
    return result


def markdown(results: Mapping[str, Any]) -> str:
    all_limits = results["machine"]["limits"]
    any_limits = next(iter(all_limits.values()))
    lines = [
        f"Measured {results['date']} on {results['machine']['cpu']} ({results['machine']['cores']} cores), "
        f"torch {results['versions']['torch']}, transformers {results['versions']['transformers']}, "
        f"TRL {results['versions']['trl']}, {results['workload']['threads']} torch threads in both. "
        f"Command: `{results['command']}`.",
        "",
        "Machine limits: fp32 matrix multiply "
        + ", ".join(f"{size} {limits['gemm_gflops']:.0f} GFLOP/s" for size, limits in all_limits.items())
        + f" (at the model's shapes, {any_limits['gemm_rows']} rows); "
        f"memory copy {any_limits['copy_gbytes_per_second']:.1f} GB/s; a Python process that has "
        f"only imported torch: {_mib(results['machine']['import_torch_rss_bytes'])}.",
        "",
    ]
    for precision, table in results["tables"].items():
        lines += [
            f"**{precision}** (medians over {results['measured_steps']} steps after "
            f"{results['warmup_steps']} warm-up steps; ratio = Rollout / TRL, one per repeat)",
            "",
            "| model | KL | completions/s Rollout | TRL | ratio | tokens/s ratio "
            "| peak RSS Rollout | TRL | ratio | ratio above torch "
            "| compute-bound fraction Rollout | TRL |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        floor = results["machine"]["import_torch_rss_bytes"]
        for row in table:
            h = row["headline"]
            rss = h["peak_rss_bytes"]
            lines.append(
                f"| {row['size']} | {row['kl_coef']:g} "
                f"| {h['completions_per_second']['rollout']:.0f} | {h['completions_per_second']['trl']:.0f} "
                f"| **{h['throughput_ratio']:.2f}x** ({_list(h['throughput_ratio_per_repeat'])}) "
                f"| {h['generated_tokens_ratio']:.2f}x "
                f"| {_mib(rss['rollout'])} | {_mib(rss['trl'])} "
                f"| **{h['memory_ratio']:.2f}x** ({_list(h['memory_ratio_per_repeat'])}) "
                f"| {ratio(rss['rollout'] - floor, rss['trl'] - floor):.2f}x "
                f"| {h['compute_bound_fraction']['rollout']:.2f} | {h['compute_bound_fraction']['trl']:.2f} |"
            )
        lines += ["", "Seconds per step by phase, median (first repeat):", ""]
        lines += [
            "| model | KL | framework | " + " | ".join(PHASES) + " | step |",
            "|---|---|---|" + "---|" * 7,
        ]
        for row in table:
            for fw in ("rollout", "trl"):
                run = row["pairs"][0][fw]
                phases = " | ".join(f"{run['phase_seconds'][name]:.3f}" for name in PHASES)
                lines.append(
                    f"| {row['size']} | {row['kl_coef']:g} | {fw} | {phases} | {run['step_seconds']:.3f} |"
                )
        lines.append("")
    learning = results.get("learning")
    if learning:
        lines += [
            "Learning check: both from the same warm-started checkpoint, KL 0, fp32, "
            + ", ".join(f"{size} {steps} steps" for size, steps in learning["steps"].items())
            + f" of {results['workload']['completions_per_step']} completions. Mean exact-match reward:",
            "",
            "| model | framework | first 10 steps | last 10 steps | second half | whole run |",
            "|---|---|---|---|---|---|",
        ]
        for size, curves in learning["curves"].items():
            for fw in ("rollout", "trl"):
                c = curves[fw]
                lines.append(
                    f"| {size} | {fw} | {statistics.fmean(c[:10]):.3f} | {statistics.fmean(c[-10:]):.3f} "
                    f"| {statistics.fmean(c[len(c) // 2 :]):.3f} | {statistics.fmean(c):.3f} |"
                )
        lines.append("")
        for size, verdict in learning["verdicts"].items():
            lines.append(
                f"- {size}: Rollout - TRL over the second half {verdict['difference']:+.3f} "
                f"(standard error {verdict['standard_error']:.3f}): "
                + ("not worse." if verdict["not_worse"] else "**worse** (by more than two standard errors).")
            )
        lines += ["", f"![reward curves](./{PLOT.name})", ""]
    return "\n".join(lines)


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f} MiB"


def _list(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOCS} lacks the {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def plot_learning(curves: Mapping[str, Mapping[str, Sequence[float]]], per_step: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, len(curves), figsize=(5.5 * len(curves), 3.8), squeeze=False)
    for axis, (size, by_framework) in zip(axes[0], curves.items(), strict=True):
        for (framework, rewards), colour in zip(
            by_framework.items(), ("tab:blue", "tab:orange"), strict=False
        ):
            completions = [per_step * (i + 1) for i in range(len(rewards))]
            axis.plot(completions, rewards, color=colour, alpha=0.25, linewidth=1)
            axis.plot(completions, moving_average(rewards, 10), color=colour, label=framework, linewidth=2)
        axis.set_title(f"{size} model, KL 0, fp32 (thin: per step, thick: 10-step mean)", fontsize=9)
        axis.set_xlabel("completions")
        axis.set_ylabel("exact-match reward")
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(PLOT, dpi=110)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


# Main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollout", type=Path, help="the rollout binary (required unless --report-only)")
    parser.add_argument("--sizes", default="tiny,small", help="comma-separated: tiny, small")
    parser.add_argument("--kl", default="0,0.04", help="comma-separated KL coefficients")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--repeats", type=int, default=2, help="Rollout/TRL pairs per configuration")
    parser.add_argument("--bf16-repeats", type=int, default=1, help="pairs per bf16 configuration")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--steps", type=int, default=15, help="steps per speed run")
    parser.add_argument(
        "--learning-steps",
        default="tiny=150,small=60",
        help="steps of the learning check per size; '' skips it",
    )
    parser.add_argument("--work", type=Path, default=REPO / "artifacts" / "bench-e2e-vs-trl")
    parser.add_argument(
        "--report-only", action="store_true", help=f"only redo the docs and plot from {RESULTS.name}"
    )
    parser.add_argument(
        "--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md or the plot"
    )
    args = parser.parse_args(argv)
    if args.rollout is None and not args.report_only:
        parser.error("--rollout is required")
    if args.steps - args.warmup < 10:
        parser.error("--steps must leave at least 10 measured steps after --warmup")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        report(json.loads(RESULTS.read_text()))
        return 0
    import torch
    import transformers
    import trl
    from transformers.utils import logging as transformers_logging

    from python_plugins.quickstart import write_addition_splits

    transformers_logging.disable_progress_bar()

    workload = Workload()
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "runs", ignore_errors=True)
    data, _ = write_addition_splits(work / "data", train=4000, test=200, seed=0)
    sizes = [SIZES[name] for name in args.sizes.split(",") if name]
    kls = [float(value) for value in args.kl.split(",") if value]
    python = Path(sys.executable)

    models: dict[str, Path] = {}
    configs: dict[str, dict[str, Any]] = {}
    limits: dict[str, dict[str, Any]] = {}
    print("preparing models", flush=True)
    for size in sizes:
        models[size.name] = warm_start(args.rollout, work, size, data, workload)
        configs[size.name] = json.loads((models[size.name] / "config.json").read_text())
    print("measuring the machine", flush=True)
    # What any process pays before doing anything: the interpreter with torch imported.
    torch_floor = run_measured([str(python), "-c", "import torch"], work / "logs" / "import-torch.log")
    for size in sizes:
        # Training passes see about completions x (prompt + completion) tokens at once.
        limits[size.name] = machine_limits(configs[size.name], rows=768, threads=workload.threads)

    def run_pair(size: ModelSize, kl: float, precision: str, steps: int, repeat: int) -> dict[str, Any]:
        pair: dict[str, Any] = {"repeat": repeat}
        order = ("rollout", "trl") if repeat % 2 == 0 else ("trl", "rollout")
        for framework in order:
            label = f"{framework}-{size.name}-{precision}-kl{kl:g}-{steps}steps-r{repeat}"
            spec = RunSpec(framework, size.name, models[size.name], kl, precision, steps, label)
            if framework == "rollout":
                command, metrics = rollout_command(spec, args.rollout, work, data, workload)
            else:
                command, metrics = trl_command(spec, python, work, data, workload)
            print(f"  {label}", end="", flush=True)
            process = run_measured(command, work / "logs" / f"{label}.log")
            steps_done = read_steps(framework, metrics)
            summary = summarise(
                steps_done, args.warmup, configs[size.name], kl > 0, limits[size.name]["gemm_gflops"]
            )
            pair[framework] = {**summary, **process, "rewards": [s["reward_mean"] for s in steps_done]}
            print(
                f": {summary['completions_per_second']:.0f} completions/s, "
                f"{process['peak_rss_bytes'] / 2**20:.0f} MiB, {summary['step_seconds']:.3f} s/step",
                flush=True,
            )
        pair["ratios"] = pair_ratios(pair["rollout"], pair["trl"])
        return pair

    tables: dict[str, list[dict[str, Any]]] = {}
    for precision in args.precisions.split(","):
        repeats = args.repeats if precision == "fp32" else args.bf16_repeats
        print(f"speed runs, {precision}", flush=True)
        rows = []
        for size in sizes:
            for kl in kls if precision == "fp32" else kls[:1]:
                pairs = [run_pair(size, kl, precision, args.steps, repeat) for repeat in range(repeats)]
                rows.append({"size": size.name, "kl_coef": kl, "pairs": pairs, "headline": headline(pairs)})
        tables[precision] = rows

    learning: dict[str, Any] | None = None
    learning_steps = dict(item.split("=") for item in args.learning_steps.split(",") if item)
    if learning_steps:
        print("learning check", flush=True)
        curves: dict[str, dict[str, list[float]]] = {}
        for size in sizes:
            if size.name in learning_steps:
                pair = run_pair(size, 0.0, "fp32", int(learning_steps[size.name]), repeat=0)
                curves[size.name] = {fw: pair[fw]["rewards"] for fw in ("rollout", "trl")}
        learning = {
            "steps": learning_steps,
            "curves": curves,
            "verdicts": {size: learning_verdict(c["rollout"], c["trl"]) for size, c in curves.items()},
        }

    fp32 = {row["size"]: row for row in tables.get("fp32", []) if row["kl_coef"] == 0.0}
    results = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(
            ["bench/e2e_vs_trl", *user_arguments(argv if argv is not None else sys.argv[1:])]
        ),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "python": platform.python_version(),
        },
        "machine": {
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "limits": limits,
            "import_torch_rss_bytes": torch_floor["peak_rss_bytes"],
        },
        "workload": {**dataclasses.asdict(workload), "completions_per_step": workload.completions_per_step},
        "warmup_steps": args.warmup,
        "measured_steps": args.steps - args.warmup,
        # The headline per size: fp32, no KL term, medians over the repeats.
        **{
            size: {
                "parameters": sum(n_in * n_out for n_in, n_out in matmul_shapes(configs[size]))
                + configs[size]["vocab_size"] * configs[size]["hidden_size"],
                "completions_per_second": row["headline"]["completions_per_second"],
                "peak_rss_bytes": row["headline"]["peak_rss_bytes"],
                "throughput_ratio": row["headline"]["throughput_ratio"],
                "memory_ratio": row["headline"]["memory_ratio"],
                "compute_bound_fraction": row["headline"]["compute_bound_fraction"],
            }
            for size, row in fp32.items()
        },
        "tables": tables,
        "learning": learning,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")
    if not args.no_docs:
        report(results)
    return 0


def report(results: Mapping[str, Any]) -> None:
    """The plot and the tables in the docs, from ``results``."""
    learning = results.get("learning")
    if learning and learning["curves"]:
        plot_learning(learning["curves"], results["workload"]["completions_per_step"])
    write_docs(markdown(results))
    print(f"updated {DOCS.relative_to(REPO)} and {PLOT.relative_to(REPO)}")


def user_arguments(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--rollout PATH``, which the ``bench/e2e_vs_trl`` wrapper adds."""
    kept, skip = [], False
    for argument in argv:
        if skip:
            skip = False
        elif argument == "--rollout":
            skip = True
        elif not argument.startswith("--rollout="):
            kept.append(argument)
    return kept


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    raise SystemExit(main())
