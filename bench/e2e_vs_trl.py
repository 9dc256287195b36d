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
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.e2e.flops import machine_limits, matmul_shapes  # noqa: E402
from bench.e2e.processes import run_measured  # noqa: E402
from bench.e2e.report import headline, learning_verdict, other_hosts, pair_ratios, report  # noqa: E402
from bench.e2e.runs import (  # noqa: E402
    SIZES,
    ModelSize,
    RunSpec,
    Workload,
    read_steps,
    rollout_command,
    summarise,
    trl_command,
    warm_start,
)

RESULTS = REPO / "bench" / "results" / "e2e_vs_trl.json"


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
    parser.add_argument(
        "--overlap",
        default="tiny",
        help="comma-separated sizes whose Rollout runs overlap generation with training "
        "(cluster.max_staleness = 1, half the torch threads per copy); '' for none",
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


@dataclasses.dataclass(frozen=True)
class Bench:
    """What every run of the benchmark shares: the options, the data, the warm-started model
    of each size and the machine's limits at its shapes."""

    args: argparse.Namespace
    work: Path
    data: Path
    workload: Workload
    sizes: list[ModelSize]
    models: dict[str, Path]
    configs: dict[str, dict[str, Any]]
    limits: dict[str, dict[str, Any]]
    import_torch_rss_bytes: int
    versions: dict[str, str]

    @classmethod
    def prepare(cls, args: argparse.Namespace) -> Bench:
        # Imported first: a missing TRL fails the benchmark before minutes of warm starts.
        import torch
        import transformers
        import trl

        from python_plugins.quickstart import write_addition_splits

        versions = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "python": platform.python_version(),
        }

        workload = Workload()
        work: Path = args.work.resolve()
        work.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work / "runs", ignore_errors=True)
        data, _ = write_addition_splits(work / "data", train=4000, test=200, seed=0)
        sizes = [SIZES[name] for name in args.sizes.split(",") if name]
        print("preparing models", flush=True)
        models = {size.name: warm_start(args.rollout, work, size, data, workload) for size in sizes}
        configs = {name: json.loads((model / "config.json").read_text()) for name, model in models.items()}
        print("measuring the machine", flush=True)
        # What any process pays before doing anything: the interpreter with torch imported.
        torch_floor = run_measured([sys.executable, "-c", "import torch"], work / "logs" / "import-torch.log")
        # Training passes see about completions x (prompt + completion) tokens at once.
        limits = {
            name: machine_limits(config, rows=768, threads=workload.threads)
            for name, config in configs.items()
        }
        return cls(
            args,
            work,
            data,
            workload,
            sizes,
            models,
            configs,
            limits,
            torch_floor["peak_rss_bytes"],
            versions,
        )

    def run_pair(self, size: ModelSize, kl: float, precision: str, steps: int, repeat: int) -> dict[str, Any]:
        """Rollout and TRL on the same work, the first of the two alternating with `repeat`."""
        pair: dict[str, Any] = {"repeat": repeat}
        order = ("rollout", "trl") if repeat % 2 == 0 else ("trl", "rollout")
        for framework in order:
            label = f"{framework}-{size.name}-{precision}-kl{kl:g}-{steps}steps-r{repeat}"
            overlap = framework == "rollout" and size.name in self.args.overlap.split(",")
            spec = RunSpec(framework, size.name, self.models[size.name], kl, precision, steps, label, overlap)
            if framework == "rollout":
                command, metrics = rollout_command(
                    spec, self.args.rollout, self.work, self.data, self.workload
                )
            else:
                command, metrics = trl_command(
                    spec, Path(sys.executable), self.work, self.data, self.workload
                )
            print(f"  {label}", end="", flush=True)
            process = run_measured(command, self.work / "logs" / f"{label}.log")
            steps_done = read_steps(framework, metrics)
            summary = summarise(
                steps_done,
                self.args.warmup,
                self.configs[size.name],
                kl > 0,
                self.limits[size.name]["gemm_gflops"],
            )
            pair[framework] = {
                **summary,
                **process,
                "rewards": [s["reward_mean"] for s in steps_done],
                "overlapped": overlap,
            }
            print(
                f": {summary['completions_per_second']:.0f} completions/s, "
                f"{process['peak_rss_bytes'] / 2**20:.0f} MiB, {summary['step_seconds']:.3f} s/step",
                flush=True,
            )
        pair["ratios"] = pair_ratios(pair["rollout"], pair["trl"])
        return pair

    def speed_tables(self) -> dict[str, list[dict[str, Any]]]:
        """Each precision's rows: every size with every KL value (bf16: the first only)."""
        args = self.args
        kls = [float(value) for value in args.kl.split(",") if value]
        tables: dict[str, list[dict[str, Any]]] = {}
        for precision in args.precisions.split(","):
            repeats = args.repeats if precision == "fp32" else args.bf16_repeats
            print(f"speed runs, {precision}", flush=True)
            rows = []
            for size in self.sizes:
                for kl in kls if precision == "fp32" else kls[:1]:
                    pairs = [
                        self.run_pair(size, kl, precision, args.steps, repeat) for repeat in range(repeats)
                    ]
                    rows.append(
                        {"size": size.name, "kl_coef": kl, "pairs": pairs, "headline": headline(pairs)}
                    )
            tables[precision] = rows
        return tables

    def learning_check(self) -> dict[str, Any] | None:
        """Longer runs from the same checkpoint, their reward curves compared."""
        learning_steps = dict(item.split("=") for item in self.args.learning_steps.split(",") if item)
        if not learning_steps:
            return None
        print("learning check", flush=True)
        curves: dict[str, dict[str, list[float]]] = {}
        for size in self.sizes:
            if size.name in learning_steps:
                pair = self.run_pair(size, 0.0, "fp32", int(learning_steps[size.name]), repeat=0)
                curves[size.name] = {fw: pair[fw]["rewards"] for fw in ("rollout", "trl")}
        return {
            "steps": learning_steps,
            "curves": curves,
            "verdicts": {size: learning_verdict(c["rollout"], c["trl"]) for size, c in curves.items()},
        }

    def results(
        self, argv: Sequence[str], tables: dict[str, list[dict[str, Any]]], learning: dict[str, Any] | None
    ) -> dict[str, Any]:
        """`bench/results/e2e_vs_trl.json`, with the headline per size: fp32, no KL term, medians
        over the repeats."""
        fp32 = {row["size"]: row for row in tables.get("fp32", []) if row["kl_coef"] == 0.0}
        return {
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["bench/e2e_vs_trl", *user_arguments(argv)]),
            "versions": self.versions,
            "machine": {
                "cpu": _cpu_name(),
                "cores": os.cpu_count(),
                "limits": self.limits,
                "import_torch_rss_bytes": self.import_torch_rss_bytes,
            },
            "workload": {
                **dataclasses.asdict(self.workload),
                "completions_per_step": self.workload.completions_per_step,
            },
            "warmup_steps": self.args.warmup,
            "measured_steps": self.args.steps - self.args.warmup,
            **{size: self.size_figures(size, row) for size, row in fp32.items()},
            "tables": tables,
            "learning": learning,
        }

    def size_figures(self, size: str, row: dict[str, Any]) -> dict[str, Any]:
        """A size's figures at the top of the results: its parameters and its row's headline."""
        config = self.configs[size]
        return {
            "parameters": sum(n_in * n_out for n_in, n_out in matmul_shapes(config))
            + config["vocab_size"] * config["hidden_size"],
            **{
                key: row["headline"][key]
                for key in (
                    "completions_per_second",
                    "peak_rss_bytes",
                    "throughput_ratio",
                    "memory_ratio",
                    "compute_bound_fraction",
                    "train_compute_bound_fraction",
                )
            },
        }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        report(json.loads(RESULTS.read_text()))
        return 0
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    bench = Bench.prepare(args)
    tables = bench.speed_tables()
    learning = bench.learning_check()
    results = bench.results(argv if argv is not None else sys.argv[1:], tables, learning)
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else None
    results["other_hosts"] = other_hosts(previous, results["machine"]["cpu"])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")
    if not args.no_docs:
        report(results)
    return 0


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
