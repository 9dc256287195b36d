"""Rollout's sampling engine against Hugging Face ``generate`` with static batches.

Same ~25M-parameter local model (hidden 512, 8 layers), same prompts, same per-sample token
budgets (heavy-tailed between 8 and 128), same sampling (temperature 1), end-of-sequence
ignored in both so the work is exactly the budgets, and torch limited to the same number of
threads. Throughput counts the tokens each sample asked for; the static batch also computes
the tokens a finished row keeps producing until the batch's longest sample is done, which is
the waste continuous batching removes.

Run with ``bench/engine``; writes ``bench/results/engine.json`` and the table in
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.distributed import cpu_model  # noqa: E402
from bench.e2e.flops import forward_gemm_seconds, matmul_shapes  # noqa: E402
from bench.hosts import carry_other_hosts  # noqa: E402
from python_plugins.decode_matmuls import host_gains_from_weight_first  # noqa: E402
from python_plugins.quickstart import create_tiny_model  # noqa: E402

RESULTS = REPO / "bench" / "results" / "engine.json"
# How `engine_matmuls = "auto"` multiplies a decode step's few rows on this host, and the other
# form (python_plugins/decode_matmuls.py).
TAIL_MATMULS = "weight_first_tail" if host_gains_from_weight_first() else "linear"
OTHER_TAIL_MATMULS = "linear" if TAIL_MATMULS == "weight_first_tail" else "weight_first_tail"
# Each feature is measured by running the engine without it right before or right after the
# engine with it, in turns.
ABLATIONS = {
    "shared_prefix_attention": ("--set", "policy.options.shared_prefix_attention=false"),
    "host_tail_matmuls": ("--set", f'policy.options.engine_matmuls="{OTHER_TAIL_MATMULS}"'),
}
# An engine run's figures kept for its host when the next run is on another.
HOST_FIGURES = (
    "date",
    "command",
    "machine",
    "tokens_per_second_rollout",
    "tokens_per_second_hf_generate",
    "speedup_vs_hf_generate",
    "compute_bound_fraction_per_query_token",
    "compute_bound_fraction_at_peak_gemm",
)
DOCS = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- engine:begin -->", "<!-- engine:end -->"
WORDS = "the a of to and in is it that for on with as at by this be are from or an".split()


def heavy_tailed_budgets(
    rng: np.random.Generator, count: int, low: int, high: int, alpha: float
) -> list[int]:
    """Pareto(alpha) truncated to [low, high] by inverse transform: most samples are short."""
    u = rng.random(count)
    ratio = (low / high) ** alpha
    values = low / (1.0 - u * (1.0 - ratio)) ** (1.0 / alpha)
    return [int(v) for v in np.clip(np.floor(values), low, high)]


def make_workload(rng: np.random.Generator, prompts: int, group: int, args: argparse.Namespace) -> list[dict]:
    records = []
    for _ in range(prompts):
        words = rng.choice(WORDS, size=int(rng.integers(args.prompt_words_min, args.prompt_words_max + 1)))
        records.append(
            {
                "prompt": " ".join(words),
                "budgets": heavy_tailed_budgets(rng, group, args.min_tokens, args.max_tokens, args.alpha),
            }
        )
    return records


def hf_generate(model_dir: Path, records: list[dict], group: int, batch_prompts: int, seed: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id
    torch.manual_seed(seed)
    useful = computed = 0
    started = time.perf_counter()
    for first in range(0, len(records), batch_prompts):
        batch = records[first : first + batch_prompts]
        rows = [
            tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in batch for _ in range(group)
        ]
        budgets = [b for r in batch for b in r["budgets"]]
        width = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row)
            attention[i, width - len(row) :] = 1
        longest = max(budgets)
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=pad,
            )
        useful += sum(budgets)
        computed += longest * len(rows)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "useful_tokens": useful,
        "computed_tokens": computed,
        "tokens_per_second": useful / seconds,
    }


def rollout_generate(
    rollout: str,
    model_dir: Path,
    records: list[dict],
    group: int,
    args: argparse.Namespace,
    work: Path,
    overrides: tuple[str, ...] = (),
) -> dict:
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = work / "engine.toml"
    config.write_text(
        f"""
[run]
output_dir = "{work / "out"}"
seed = {args.seed}

[policy]
plugin = "python_plugins.hf_policy:HFCausalLM"
options = {{ model_path = "{model_dir}", torch_threads = {args.threads} }}

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{data}" }}
shuffle = false

[[rewards]]
plugin = "python_plugins.rewards:Format"
options = {{ pattern = ".*" }}

[rollout]
group_size = {group}
max_new_tokens = {args.max_tokens}
max_new_tokens_field = "budgets"
ignore_eos = true
temperature = 1.0
"""
    )
    result = subprocess.run(
        [rollout, "generate", str(config), *args.rollout_set, *overrides],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if result.returncode != 0:
        raise SystemExit(f"rollout generate failed:\n{result.stderr}")
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    expected = sum(sum(r["budgets"]) for r in records)
    if stats["generated_tokens"] != expected:
        raise SystemExit(f"rollout generated {stats['generated_tokens']} tokens, expected {expected}")
    return stats


def rows_per_step(records: list[dict], prompt_tokens: int) -> list[int]:
    """Query tokens of each engine step on this workload: every prompt prefilled once in the
    first step (its first token sampled there), then one decode per sample still short of its
    budget."""
    budgets = np.asarray([b for r in records for b in r["budgets"]])
    return [prompt_tokens] + [int((budgets > k).sum()) for k in range(1, int(budgets.max()))]


def compute_bound(config: dict, rows: list[int]) -> dict:
    """The model's weight matmuls alone, measured on this machine in fp32 at each step's own
    batch size (the bound for this workload), and the same FLOPs at the best rate of any batch
    size (the bound if every step were large)."""
    grid = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 768, *rows})
    seconds_at = {r: forward_gemm_seconds(config, r) for r in grid}
    flops_per_token = sum(2 * n_in * n_out for n_in, n_out in matmul_shapes(config))
    peak_rate = max(flops_per_token * r / t for r, t in seconds_at.items())
    return {
        "gemm_bound_seconds": sum(seconds_at[r] for r in rows),
        "peak_gemm_bound_seconds": flops_per_token * sum(rows) / peak_rate,
        "gemm_gflops_by_rows": {r: flops_per_token * r / t / 1e9 for r, t in seconds_at.items()},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollout", required=True, help="the rollout binary")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--batch-prompts", type=int, default=8, help="prompts per static HF batch")
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=1.0, help="Pareto tail index of the budgets")
    parser.add_argument("--prompt-words-min", type=int, default=8)
    parser.add_argument("--prompt-words-max", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rollout-set", nargs="*", default=[], help="extra `--set k=v` for rollout")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args()
    args.rollout_set = [item for kv in args.rollout_set for item in ("--set", kv)]
    return args


def engine_model(work: Path) -> Path:
    """The benchmark's ~25M-parameter Llama, created (seeded) on the first run."""
    model_dir = work / "llama-h512-l8-i1376"
    if not (model_dir / "config.json").exists():
        create_tiny_model(
            model_dir,
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            intermediate_size=1376,
            max_positions=256,
            seed=0,
        )
    return model_dir


def measure_repeat(
    repeat: int, engine: Callable[..., dict], hf: Callable[[int], dict], records: list[dict], config: dict
) -> dict:
    """One repeat: HF `generate`, the engine and the engine without each ablated feature (the
    ablations before the engine in even repeats, after it in odd ones), and the GEMM bound of
    the engine's steps measured right after it, so that both see the machine in one state."""
    baseline = hf(repeat)

    def ablations() -> dict[str, dict]:
        return {name: engine(overrides) for name, overrides in ABLATIONS.items()}

    ablated = ablations() if repeat % 2 == 0 else {}
    ours = engine()
    ablated = ablated or ablations()
    rows = rows_per_step(records, int(ours["engine/prompt_tokens_computed"]))
    if len(rows) != ours["engine/steps"]:
        print(f"note: {ours['engine/steps']} engine steps, the bound assumes {len(rows)}")
    bound = compute_bound(config, rows)
    run = {
        "hf_generate": baseline,
        "rollout": ours,
        "speedup": ours["tokens_per_second"] / baseline["tokens_per_second"],
        **{f"rollout_without_{name}": r for name, r in ablated.items()},
        **{
            f"{name}_speedup": ours["tokens_per_second"] / r["tokens_per_second"]
            for name, r in ablated.items()
        },
        "compute_bound": bound,
        "compute_bound_fraction_per_query_token": bound["gemm_bound_seconds"] / ours["engine/seconds"],
        "compute_bound_fraction_at_peak_gemm": bound["peak_gemm_bound_seconds"] / ours["engine/seconds"],
    }
    print(
        f"repeat {repeat}: rollout {ours['tokens_per_second']:.0f} tok/s, "
        f"hf generate {baseline['tokens_per_second']:.0f} tok/s, x{run['speedup']:.2f}, "
        + "".join(f"without {name} {r['tokens_per_second']:.0f} tok/s, " for name, r in ablated.items())
        + f"compute-bound fraction {run['compute_bound_fraction_per_query_token']:.2f}",
        flush=True,
    )
    return run


def summarise(args: argparse.Namespace, records: list[dict], runs: list[dict], parameters: int) -> dict:
    """`bench/results/engine.json`: medians over the repeats, the engine's own statistics from
    its fastest repeat, and every run."""

    def median(key: str) -> float:
        return float(np.median([r[key] for r in runs]))

    best = max(runs, key=lambda r: r["speedup"])["rollout"]
    budgets = [b for r in records for b in r["budgets"]]
    rows = rows_per_step(records, int(best["engine/prompt_tokens_computed"]))
    return {
        "command": "bench/engine " + " ".join(sys.argv[3:]),
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "machine": f"{cpu_model()} ({platform.machine()}), {torch.get_num_threads()} torch threads",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model": {"hidden_size": 512, "layers": 8, "parameters": parameters},
        "workload": {
            "prompts": args.prompts,
            "group_size": args.group,
            "hf_batch_rows": args.batch_prompts * args.group,
            "budget_distribution": (
                f"Pareto(alpha={args.alpha}) truncated to [{args.min_tokens}, {args.max_tokens}]"
            ),
            "budget_mean": float(np.mean(budgets)),
            "budget_max": int(max(budgets)),
            "tokens": int(sum(budgets)),
        },
        "tokens_per_second_rollout": float(np.median([r["rollout"]["tokens_per_second"] for r in runs])),
        "tokens_per_second_hf_generate": float(
            np.median([r["hf_generate"]["tokens_per_second"] for r in runs])
        ),
        "speedup_vs_hf_generate": median("speedup"),
        **{f"{name}_speedup": median(f"{name}_speedup") for name in ABLATIONS},
        "tail_matmuls": {"auto": TAIL_MATMULS, "against": OTHER_TAIL_MATMULS},
        "compute_bound_fraction_per_query_token": median("compute_bound_fraction_per_query_token"),
        "compute_bound_fraction_at_peak_gemm": median("compute_bound_fraction_at_peak_gemm"),
        "query_tokens_per_run": int(sum(rows)),
        "steps_per_run": len(rows),
        "overhead_fraction": best.get("engine/overhead_fraction"),
        "kv_utilisation": best.get("engine/kv_utilisation_mean"),
        "kv_occupancy": best.get("engine/kv_occupancy_mean"),
        "prompt_tokens_computed_fraction": (
            best["engine/prompt_tokens_computed"] / best["engine/prompt_tokens_requested"]
        ),
        "runs": runs,
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    transformers_logging.disable_progress_bar()
    work = REPO / "artifacts" / "bench-engine"
    model_dir = engine_model(work)
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    records = make_workload(np.random.default_rng(args.seed), args.prompts, args.group, args)
    config = json.loads((model_dir / "config.json").read_text())
    engine = functools.partial(rollout_generate, args.rollout, model_dir, records, args.group, args, work)

    def hf(repeat: int) -> dict:
        return hf_generate(model_dir, records, args.group, args.batch_prompts, args.seed + repeat)

    runs = [measure_repeat(repeat, engine, hf, records, config) for repeat in range(args.repeats)]
    summary = summarise(args, records, runs, parameters)
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else None
    summary["other_hosts"] = carry_other_hosts(
        previous, summary["cpu"], lambda results: results["cpu"], host_figures
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    if not args.no_docs:
        update_docs(summary)


def host_figures(results: dict) -> dict:
    return {key: results[key] for key in HOST_FIGURES}


def other_host_lines(summary: dict) -> list[str]:
    """One line per other host: its latest figures, from `other_hosts`."""
    lines = [
        f"The latest run on {cpu} ({host['date']}, `{host['command'].strip()}`, {host['machine']}): "
        f"compute-bound fraction **{host['compute_bound_fraction_per_query_token']:.2f}** "
        f"({host['compute_bound_fraction_at_peak_gemm']:.2f} against the best GEMM rate), "
        f"{host['tokens_per_second_rollout']:.0f} tokens/s, {host['speedup_vs_hf_generate']:.2f}x HF "
        "`generate`."
        for cpu, host in summary.get("other_hosts", {}).items()
    ]
    return [*lines, ""] if lines else []


def update_docs(summary: dict) -> None:
    tail = summary["tail_matmuls"]
    rows = [
        "| run | Rollout engine tok/s | HF generate tok/s | speed-up | compute-bound fraction "
        "| engine without shared-prefix attention tok/s | its gain "
        f"| engine with `engine_matmuls = \"{tail['against']}\"` tok/s | this host's tail matmuls' gain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, run in enumerate(summary["runs"]):
        rows.append(
            f"| {i + 1} | {run['rollout']['tokens_per_second']:.0f} | "
            f"{run['hf_generate']['tokens_per_second']:.0f} | {run['speedup']:.2f}x | "
            f"{run['compute_bound_fraction_per_query_token']:.2f} | "
            f"{run['rollout_without_shared_prefix_attention']['tokens_per_second']:.0f} | "
            f"{run['shared_prefix_attention_speedup']:.2f}x | "
            f"{run['rollout_without_host_tail_matmuls']['tokens_per_second']:.0f} | "
            f"{run['host_tail_matmuls_speedup']:.2f}x |"
        )
    workload = summary["workload"]
    overhead = summary["overhead_fraction"]
    kv = summary["kv_utilisation"]
    table = "\n".join(
        [
            BEGIN,
            f"Measured {summary['date']} with `{summary['command'].strip()}` "
            f"({summary['machine']}; torch {summary['versions']['torch']}, "
            f"transformers {summary['versions']['transformers']}).",
            "",
            f"Model: {summary['model']['parameters'] / 1e6:.1f}M parameters (hidden 512, 8 layers). "
            f"Workload: {workload['prompts']} prompts x {workload['group_size']} samples, budgets "
            f"{workload['budget_distribution']} "
            f"(mean {workload['budget_mean']:.1f}, max {workload['budget_max']}), "
            f"{workload['tokens']} tokens; HF static batches of {workload['hf_batch_rows']} rows.",
            "",
            *other_host_lines(summary),
            *rows,
            "",
            f"Median speed-up **{summary['speedup_vs_hf_generate']:.2f}x**"
            + (
                f"; engine time outside the model forward pass: **{overhead:.1%}**; mean KV-cache "
                f"utilisation: **{kv:.1%}**."
                if overhead is not None and kv is not None
                else "."
            ),
            "",
            "Shared-prefix attention (`policy.options.shared_prefix_attention`, on by default) "
            f"gains **{summary['shared_prefix_attention_speedup']:.2f}x** (median of the per-run "
            "ratios; each run has the engine without it right before or right after, in turns); "
            'the matmuls `policy.options.engine_matmuls = "auto"` (the default) picks on this '
            f'host for steps of few rows, `"{tail["auto"]}"`, gain '
            f"**{summary['host_tail_matmuls_speedup']:.2f}x**, measured the same way against "
            f'`"{tail["against"]}"`.',
            "",
            "Compute-bound fraction per query token (median over the runs): "
            f"**{summary['compute_bound_fraction_per_query_token']:.2f}**: the model's weight matmuls "
            f"alone, measured here in fp32 right after each run at each of its {summary['steps_per_run']} "
            "steps' own batch size, over the engine's seconds. Against the best GEMM rate of any "
            f"batch size: {summary['compute_bound_fraction_at_peak_gemm']:.2f}.",
            END,
        ]
    )
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + table + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n## Sampling engine\n\n" + table + "\n"
    DOCS.write_text(text)


if __name__ == "__main__":
    main()
