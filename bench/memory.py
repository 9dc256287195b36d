"""The memory planner (`rollout plan`) against measured peaks, and what each memory option costs.

Every configuration is the same short GRPO run (8 prompts x 8 samples of exactly 32 tokens,
`CoinFlip` rewards so that every row is trained) on a locally created Llama: the ~1M-parameter
"tiny" or the ~25M-parameter "small" (hidden 512, 8 layers). Each run is a fresh `rollout run`
process; its peak resident memory is the kernel's high-water mark (`VmHWM`), checked against
the polled resident set of the process tree every 20 ms (`bench/e2e/processes.py`). The
prediction is `rollout plan --json` for the same config. Throughput is completions per second,
the median over the steps after the first two; each run of an option follows a run of the
full fp32 case of the same model, and the option's ratio is the median over those pairs.
The machine may be shared: each pair of runs waits (up to `--wait` seconds) until other
processes use less than half a core, and the CPU time they used during each run is recorded
(`foreign_cores`).
Options that the HF policy does not have are skipped, and said so. Writes
bench/results/memory.json, the tables in docs/memory.md and the options' summary in
docs/benchmarks.md. Run `bench/memory` (it sets up the environment).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
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
BENCHMARKS_DOC = REPO / "docs" / "benchmarks.md"
ROLLOUT = REPO / "target" / "release" / "rollout"
SIZES = {
    "tiny": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 512},
    "small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1376},
}
ACCEPTED_ERROR = 0.15
PROMPT_TOKENS = 6
# Each pair of runs waits (up to `--wait` seconds) until other processes use less CPU than
# this, in cores.
MAX_FOREIGN_CORES = 0.5


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    size: str
    what: str
    policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    kl_coef: float = 0.0
    micro_batch_tokens: int = 8192
    checkpoint_every: int = 0
    # Environment of the run and of its plan.
    env: dict[str, str] = dataclasses.field(default_factory=dict)

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
# With `--pinned`: jemalloc (the binary's allocator) purges freed pages at once, so the peak is
# the memory in use, without the allocator's retention.
PINNED = {"MALLOC_CONF": "dirty_decay_ms:0,muzzy_decay_ms:0"}
PINNED_CASES = [
    Case("small-pinned", "small", "25M, fp32, freed pages purged at once", env=PINNED),
    Case(
        "small-lora-pinned",
        "small",
        "25M, LoRA rank 16, freed pages purged at once",
        {"lora_rank": 16},
        env=PINNED,
    ),
]
# The memory options side by side on the 25M model (docs/benchmarks.md).
OPTIONS = {
    "small": "full fine-tuning, fp32 AdamW",
    "small-lora": "LoRA rank 16 (q, k, v, o)",
    "small-int8": "LoRA on an int8 base",
    "small-nf4": "LoRA on an nf4 base",
    "small-adam8": "8-bit AdamW",
}


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


def predict(config: Path, env: dict[str, str]) -> dict[str, Any]:
    """`rollout plan --json`: the in-process role's host memory."""
    done = subprocess.run(
        [str(ROLLOUT), "plan", str(config), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
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


def busy_cpu_seconds() -> float:
    """CPU time the whole machine has spent busy since boot (`/proc/stat`)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU time of this process and its finished children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def run_once(case: Case, config: Path, work: Path) -> dict[str, Any]:
    command = [str(ROLLOUT), "run", str(config), "--overwrite", "--no-plan-check"]
    busy, own, started = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
    measured = run_measured(command, work / "logs" / f"{case.name}.log", env={**os.environ, **case.env})
    wall = time.perf_counter() - started
    cpu = own_cpu_seconds() - own
    foreign = max(0.0, busy_cpu_seconds() - busy - cpu) / wall
    return {
        **measured,
        **throughput(work / "runs" / case.name / "metrics.jsonl"),
        "cpu_seconds": cpu,
        "foreign_cores": foreign,
    }


def summarize(case: Case, runs: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"what": case.what, "size": case.size, "policy_options": case.policy}
    row["measured_peak_bytes"] = int(statistics.median(run["peak_rss_bytes"] for run in runs))
    row["measured_peaks"] = [run["peak_rss_bytes"] for run in runs]
    for key in ("completions_per_second", "step_seconds", "train_seconds"):
        row[key] = statistics.median(run[key] for run in runs)
    row["foreign_cores"] = [round(run["foreign_cores"], 2) for run in runs]
    row["predicted_peak_bytes"] = plan["peak_bytes"]
    row["predicted_phase"] = plan["peak_phase"]
    row["predicted_breakdown"] = {part["name"]: part["bytes"] for part in plan["components"]}
    measured = row["measured_peak_bytes"]
    row["error_fraction"] = (row["predicted_peak_bytes"] - measured) / measured
    return row


def wait_for_quiet(limit_seconds: float) -> float:
    """Wait (up to `limit_seconds`) until other processes use under `MAX_FOREIGN_CORES` over
    3 seconds; the load last seen, in cores."""
    deadline = time.perf_counter() + limit_seconds
    while True:
        busy, own, started = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
        time.sleep(3.0)
        load = max(0.0, busy_cpu_seconds() - busy - (own_cpu_seconds() - own)) / (
            time.perf_counter() - started
        )
        if load <= MAX_FOREIGN_CORES or time.perf_counter() >= deadline:
            return load


def run_pair(
    base: Case | None, case: Case, configs: dict[str, Path], work: Path, wait: float
) -> list[dict[str, Any]]:
    """A run of the baseline (unless `case` is one) then of `case`, once the machine is quiet."""
    load = wait_for_quiet(wait)
    if load > MAX_FOREIGN_CORES:
        print(f"{case.name}: other processes use {load:.2f} cores; measuring anyway", flush=True)
    return [run_once(c, configs[c.name], work) for c in ([base, case] if base else [case])]


def measure_all(
    args: argparse.Namespace, work: Path, models: dict[str, Path], data: Path
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every case `args.rounds` times, each run of an option right after a run of its model's
    full fp32 case, so that throughput ratios compare runs under the same machine load."""
    available = policy_options_available()
    every = [*CASES, *(PINNED_CASES if args.pinned else [])]
    cases = [case for case in every if not args.only or case.name in args.only]
    skipped = {
        case.name: f"the HF policy has no option {', '.join(sorted(case.needs() - available))}"
        for case in cases
        if case.needs() - available
    }
    cases = [case for case in cases if case.name not in skipped]
    baselines = {case.size: case for case in CASES if case.name == case.size}
    configs = {
        case.name: write_config(work, case, models[case.size], data, args.steps)
        for case in [*cases, *baselines.values()]
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    ratios: dict[str, list[float]] = {case.name: [] for case in cases}
    for case in cases:
        base = baselines[case.size]
        for _ in range(args.rounds):
            pair = run_pair(None if case is base else base, case, configs, work, args.wait)
            if case is not base:
                runs[base.name].append(pair[0])
                ratios[case.name].append(
                    pair[1]["completions_per_second"] / pair[0]["completions_per_second"]
                )
            runs[case.name].append(pair[-1])
        print(f"{case.name}: {json.dumps(row_brief(runs[case.name]))}", flush=True)
    results = {}
    for case in [*baselines.values(), *cases]:
        if runs.get(case.name) and case.name not in results:
            plan = predict(configs[case.name], case.env)
            results[case.name] = summarize(case, runs[case.name], plan)
    for name, row in results.items():
        base = results.get(row["size"])
        if base is None:
            continue
        row["memory_vs_fp32"] = row["measured_peak_bytes"] / base["measured_peak_bytes"]
        row["throughput_vs_fp32"] = statistics.median(ratios[name]) if ratios.get(name) else 1.0
    return results, skipped


def row_brief(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "peak_mib": round(statistics.median(run["peak_rss_bytes"] for run in runs) / 2**20),
        "completions_per_second": round(statistics.median(run["completions_per_second"] for run in runs), 2),
        "foreign_cores": round(max(run["foreign_cores"] for run in runs), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="runs per case (the median is kept)")
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument("--work", type=Path, default=REPO / "bench" / ".work" / "memory")
    parser.add_argument(
        "--wait",
        type=float,
        default=60.0,
        help="seconds to wait for other processes to quieten before each pair of runs",
    )
    parser.add_argument(
        "--pinned",
        action="store_true",
        help="also run the 25M model with and without LoRA with freed pages purged at once (slow)",
    )
    args = parser.parse_args()
    if "MALLOC_CONF" in os.environ:
        raise SystemExit("unset MALLOC_CONF: it changes what the runs keep resident")
    started = time.perf_counter()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    models = {}
    for size, shape in SIZES.items():
        models[size] = work / f"model-{size}"
        if not (models[size] / "config.json").exists():
            create_tiny_model(models[size], **shape, seed=0)
    data, _ = write_addition_splits(work / "data", train=512, test=8, seed=0)
    results, skipped = measure_all(args, work, models, data)
    for name, row in results.items():
        print(
            f"{name}: predicted {row['predicted_peak_bytes'] / 2**20:.0f} MiB, measured "
            f"{row['measured_peak_bytes'] / 2**20:.0f} MiB ({row['error_fraction']:+.1%}), "
            f"{row['completions_per_second']:.1f} completions/s",
            flush=True,
        )
    # With --only, the other configurations are kept from the previous results.
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() and args.only else {}
    merged = {**previous.get("configurations", {}), **results}
    within = sum(abs(row["error_fraction"]) <= ACCEPTED_ERROR for row in merged.values())
    when = datetime.now().isoformat(timespec="seconds")
    command = " ".join(["bench/memory", *sys.argv[1:]])
    invocation = {"when": when, "command": command, "configurations": sorted(results)}
    report = {
        "when": when,
        "command": command,
        "invocations": [*previous.get("invocations", []), invocation],
        "workload": "8 prompts x 8 samples x 32 tokens (ignore_eos), CoinFlip reward, "
        f"{args.steps} steps, 2 torch threads, one `rollout run` process per run",
        "bench_seconds": round(time.perf_counter() - started),
        "configurations": merged,
        "skipped": skipped,
        "within_15_percent": within,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    replace_block(DOC, "memory", accuracy_block(report))
    replace_block(BENCHMARKS_DOC, "memory", options_block(report))
    print(f"{within} of {len(merged)} configurations within {ACCEPTED_ERROR:.0%}; {RESULTS}")


def mib(value: float) -> str:
    return f"{value / 2**20:.0f}"


def commands(report: dict[str, Any]) -> str:
    """The invocations the results come from, the later ones replacing what they name."""
    invocations = report.get("invocations") or [{"command": report["command"]}]
    return " then ".join(f"`{invocation['command']}`" for invocation in invocations)


def load_note(report: dict[str, Any]) -> str:
    """How busy the machine was with other work during the runs."""
    loads = [load for row in report["configurations"].values() for load in row.get("foreign_cores", [])]
    if not loads:
        return ""
    return (
        f" Other processes used {statistics.mean(loads):.2f} cores on average during the runs "
        f"(at most {max(loads):.2f}) of the machine's {os.cpu_count()}."
    )


def accuracy_block(report: dict[str, Any]) -> str:
    """Every configuration: predicted against measured, and against full fp32 training."""
    rows = [
        "| configuration | predicted MiB | measured MiB | error | completions/s "
        "| throughput vs fp32 | memory vs fp32 |",
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
    return "\n".join(
        [
            f"Measured {report['when'][:10]} with {commands(report)}: {report['workload']}.",
            "",
            *rows,
            "",
            f"{report['within_15_percent']} of {len(report['configurations'])} predictions "
            f"within 15% of the measured peak.{load_note(report)}",
            *(["", *skipped] if skipped else []),
        ]
    )


def options_block(report: dict[str, Any]) -> str:
    """The memory options on the 25M model, side by side."""
    configurations = report["configurations"]
    rows = [
        "| option | peak RSS MiB | vs fp32 | completions/s | vs fp32 | planner predicted |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in OPTIONS.items():
        row = configurations.get(name)
        if row is None:
            continue
        rows.append(
            f"| {label} | {mib(row['measured_peak_bytes'])} | {row.get('memory_vs_fp32', 1.0):.2f}x "
            f"| {row['completions_per_second']:.1f} | {row.get('throughput_vs_fp32', 1.0):.2f}x "
            f"| {mib(row['predicted_peak_bytes'])} ({row['error_fraction']:+.0%}) |"
        )
    return "\n".join(
        [
            f"Measured {report['when'][:10]} with {commands(report)} (the 25M-parameter "
            f"Llama; {report['workload']}; throughput ratios are medians over runs paired with a "
            f"full fp32 run).{load_note(report)}",
            "",
            *rows,
        ]
    )


def replace_block(doc: Path, name: str, block: str) -> None:
    """Replace the text between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in `doc`."""
    if not doc.exists():
        return
    text = doc.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        doc.write_text(f"{head}{begin}\n{block}\n{end}{rest.split(end, 1)[1]}")
    else:
        print(f"{doc}: no {begin} ... {end} markers; table not written", flush=True)


if __name__ == "__main__":
    main()
