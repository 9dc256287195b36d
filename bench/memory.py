"""The memory planner (`rollout plan`) against measured peaks, and what each memory option costs.

Every configuration is the same short GRPO run (8 prompts x 8 samples of exactly 32 tokens,
`CoinFlip` rewards so that every row is trained) on a locally created Llama: the ~1M-parameter
"tiny" or the ~25M-parameter "small" (hidden 512, 8 layers). Each run is a fresh `rollout run`
process; its peak resident memory is the kernel's high-water mark (`VmHWM`), checked against
the polled resident set of the process tree every 20 ms (`bench/e2e/processes.py`). The
prediction is `rollout plan --json` for the same config. Throughput is completions per second,
the median over the steps after the first two, against the full fp32 run of the same model.
Options that the HF policy does not have (LoRA, quantization, 8-bit Adam: being added) are
skipped, and said so. Writes bench/results/memory.json and the table in docs/memory.md.
Run `bench/memory` (it sets up the environment).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.e2e.processes import run_measured  # noqa: E402
from bench.e2e.runs import write_toml  # noqa: E402
from python_plugins.quickstart import create_tiny_model, write_addition_splits  # noqa: E402

RESULTS = REPO / "bench" / "results" / "memory.json"
DOC = REPO / "docs" / "memory.md"
ROLLOUT = REPO / "target" / "release" / "rollout"
SIZES = {
    "tiny": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 512},
    "small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1376},
}
ACCEPTED_ERROR = 0.15
PROMPT_TOKENS = 6


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    size: str
    what: str
    policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    kl_coef: float = 0.0
    micro_batch_tokens: int = 8192
    checkpoint_every: int = 0

    def needs(self) -> set[str]:
        """HF policy options this case sets."""
        return set(self.policy)


CASES = [
    Case("tiny", "tiny", "1M parameters, fp32, full AdamW"),
    Case("tiny-kl", "tiny", "1M, KL to the reference (kl_coef 0.04)", kl_coef=0.04),
    Case("small", "small", "25M parameters, fp32, full AdamW"),
    Case("small-kl", "small", "25M, KL to the reference (kl_coef 0.04)", kl_coef=0.04),
    Case("small-gc", "small", "25M, gradient checkpointing", {"gradient_checkpointing": True}),
    Case("small-bf16", "small", "25M, bfloat16 weights, gradients and Adam", {"dtype": "bfloat16"}),
    Case("small-mb512", "small", "25M, micro-batches of 512 tokens", micro_batch_tokens=512),
    Case("small-ckpt", "small", "25M, background checkpoint every 2 steps", checkpoint_every=2),
    Case("small-lora", "small", "25M, LoRA rank 16 on q/k/v/o, base frozen", {"lora_rank": 16}),
    Case("small-lora-kl", "small", "25M, LoRA rank 16, KL (adapters off)", {"lora_rank": 16}, kl_coef=0.04),
    Case(
        "small-int8", "small", "25M, LoRA rank 16 on an int8 base", {"lora_rank": 16, "quantization": "int8"}
    ),
    Case("small-nf4", "small", "25M, LoRA rank 16 on an nf4 base", {"lora_rank": 16, "quantization": "nf4"}),
    Case("small-adam8", "small", "25M, 8-bit AdamW", {"optimizer": "adamw_8bit"}),
]


def policy_options_available() -> set[str]:
    """The HF policy's `Config` fields, read from its source (no torch import here)."""
    source = (REPO / "python_plugins" / "hf_policy.py").read_text()
    block = source.split("class Config", 1)[-1].split("def __post_init__", 1)[0]
    return set(re.findall(r"^\s{8}(\w+)\s*:", block, flags=re.MULTILINE))


def write_config(work: Path, case: Case, model: Path, data: Path, steps: int) -> Path:
    path = work / "configs" / f"{case.name}.toml"
    write_toml(
        path,
        {
            "run": {
                "name": case.name,
                "seed": 0,
                "steps": steps,
                "output_dir": str(work / "runs" / case.name),
                # The addition prompts ("63+11=") are 5-6 characters of the character tokenizer.
                "plan_prompt_tokens": PROMPT_TOKENS,
            },
            "python": {"paths": [str(REPO)]},
            "policy": {
                "plugin": "python_plugins.hf_policy:HFCausalLM",
                "options": {"model_path": str(model), "torch_threads": 2, **case.policy},
            },
            "data": {
                "plugin": "python_plugins.data:JsonlPrompts",
                "options": {"path": str(data), "template": "{question}"},
            },
            "[]rewards": {"plugin": "bench.memory_plugins:CoinFlip"},
            "rollout": {"prompts_per_step": 8, "group_size": 8, "max_new_tokens": 32, "ignore_eos": True},
            "algorithm": {"kl_coef": case.kl_coef},
            "train": {"learning_rate": 1e-5, "micro_batch_tokens": case.micro_batch_tokens},
            "checkpoint": {"every": case.checkpoint_every, "keep": 1},
        },
    )
    return path


def predict(config: Path) -> dict[str, Any]:
    """`rollout plan --json`: the in-process role's host memory."""
    done = subprocess.run(
        [str(ROLLOUT), "plan", str(config), "--json"], capture_output=True, text=True, cwd=REPO
    )
    if done.returncode != 0:
        raise SystemExit(f"rollout plan {config} failed:\n{done.stderr[-3000:]}")
    plan = json.loads(done.stdout)
    return next(device for device in plan["roles"][0]["devices"] if device["device"] == "cpu")


def throughput(metrics: Path) -> dict[str, float]:
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    later = lines[2:] or lines
    return {
        "completions_per_second": statistics.median(line["samples_per_second"] for line in later),
        "step_seconds": statistics.median(line["step_seconds"] for line in later),
        "train_seconds": statistics.median(line["train_seconds"] for line in later),
    }


def measure(case: Case, config: Path, work: Path, rounds: int) -> dict[str, Any]:
    runs = []
    for _ in range(rounds):
        command = [str(ROLLOUT), "run", str(config), "--overwrite", "--no-plan-check"]
        measured = run_measured(command, work / "logs" / f"{case.name}.log")
        runs.append({**measured, **throughput(work / "runs" / case.name / "metrics.jsonl")})
    return {
        "measured_peak_bytes": int(statistics.median(run["peak_rss_bytes"] for run in runs)),
        "measured_peaks": [run["peak_rss_bytes"] for run in runs],
        **{
            key: statistics.median(run[key] for run in runs)
            for key in ("completions_per_second", "step_seconds", "train_seconds")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="runs per case (the median peak is kept)")
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument("--work", type=Path, default=REPO / "bench" / ".work" / "memory")
    args = parser.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    models = {}
    for size, shape in SIZES.items():
        models[size] = work / f"model-{size}"
        if not (models[size] / "config.json").exists():
            create_tiny_model(models[size], **shape, seed=0)
    data, _ = write_addition_splits(work / "data", train=512, test=8, seed=0)
    available = policy_options_available()

    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        missing = sorted(case.needs() - available)
        if missing:
            skipped[case.name] = f"the HF policy has no option {', '.join(missing)}"
            print(f"{case.name}: skipped ({skipped[case.name]})", flush=True)
            continue
        config = write_config(work, case, models[case.size], data, args.steps)
        plan = predict(config)
        row: dict[str, Any] = {"what": case.what, "size": case.size, "policy_options": case.policy}
        row.update(measure(case, config, work, args.rounds))
        row["predicted_peak_bytes"] = plan["peak_bytes"]
        row["predicted_phase"] = plan["peak_phase"]
        row["predicted_breakdown"] = {part["name"]: part["bytes"] for part in plan["components"]}
        row["error_fraction"] = (row["predicted_peak_bytes"] - row["measured_peak_bytes"]) / row[
            "measured_peak_bytes"
        ]
        results[case.name] = row
        print(
            f"{case.name}: predicted {row['predicted_peak_bytes'] / 2**20:.0f} MiB, measured "
            f"{row['measured_peak_bytes'] / 2**20:.0f} MiB ({row['error_fraction']:+.1%}), "
            f"{row['completions_per_second']:.1f} completions/s",
            flush=True,
        )
    for row in results.values():
        base = results.get(row["size"])
        if base is not None:
            row["throughput_vs_fp32"] = row["completions_per_second"] / base["completions_per_second"]
            row["memory_vs_fp32"] = row["measured_peak_bytes"] / base["measured_peak_bytes"]
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() and args.only else {}
    merged = {**previous.get("configurations", {}), **results}
    within = sum(abs(row["error_fraction"]) <= ACCEPTED_ERROR for row in merged.values())
    report = {
        "when": datetime.now().isoformat(timespec="seconds"),
        "command": "bench/memory " + " ".join(sys.argv[1:]),
        "workload": "8 prompts x 8 samples x 32 tokens (ignore_eos), CoinFlip reward, "
        f"{args.steps} steps, 2 torch threads, one `rollout run` process per configuration",
        "configurations": merged,
        "skipped": skipped,
        "within_15_percent": within,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    write_doc_table(report)
    print(f"{within} of {len(merged)} configurations within {ACCEPTED_ERROR:.0%}; {RESULTS}")


def mib(value: float) -> str:
    return f"{value / 2**20:.0f}"


def write_doc_table(report: dict[str, Any]) -> None:
    """Replace the table between the `memory:begin`/`memory:end` markers of docs/memory.md."""
    if not DOC.exists():
        return
    rows = [
        "| configuration | predicted MiB | measured MiB | error | completions/s "
        "| vs fp32 throughput | vs fp32 memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in report["configurations"].items():
        rows.append(
            f"| `{name}`: {row['what']} | {mib(row['predicted_peak_bytes'])} "
            f"| {mib(row['measured_peak_bytes'])} "
            f"| {row['error_fraction']:+.1%} | {row['completions_per_second']:.1f} "
            f"| {row.get('throughput_vs_fp32', 1.0):.2f}x | {row.get('memory_vs_fp32', 1.0):.2f}x |"
        )
    skipped = [f"- `{name}` skipped: {why}." for name, why in report["skipped"].items()]
    block = "\n".join(
        [
            f"Measured {report['when'][:10]} with `{report['command'].strip()}`: {report['workload']}.",
            "",
            *rows,
            "",
            f"{report['within_15_percent']} of {len(report['configurations'])} predictions "
            "within 15% of the measured peak.",
            *(["", *skipped] if skipped else []),
        ]
    )
    text = DOC.read_text()
    begin, end = "<!-- memory:begin -->", "<!-- memory:end -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        DOC.write_text(f"{head}{begin}\n{block}\n{end}{rest.split(end, 1)[1]}")


if __name__ == "__main__":
    main()
