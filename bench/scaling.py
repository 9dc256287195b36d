"""Scaling benchmark: how an RL step's time and peak memory grow with the work asked of it.

Writes bench/results/scaling.json, docs/scaling.png and the section between the
`<!-- scaling:begin -->` and `<!-- scaling:end -->` markers of docs/benchmarks.md. Run
`bench/scaling` (it sets up the environment), e.g. `bench/scaling --quick --axes length`.

One axis at a time moves away from a base workload; everything else stays fixed:

- model: ~1M, ~25M and ~100M parameters (the `tiny` and `small` models of bench/e2e and the
  101M model of bench/sharding.py), created untrained with `create_tiny_model`;
- length: completion budgets of 32 to 512 tokens;
- group: 4 to 32 samples per prompt;
- workers: generation workers under `rollout launch` (1 and 2 measured; 4 modelled, below).

`rollout.ignore_eos = true`, so every completion is exactly its budget: the untrained model
does exactly the work asked of it. The reward (the completion starts with a digit or one of
`a`-`m`) is a coin flip for an untrained model, and advantages are normalised over the step
(`batch_norm`), so every row trains. Every process runs one torch thread, so a worker is one
core. A point is one run: 1 warm-up step, then the median of the measured steps (a step's
seconds are the wall time between the ends of consecutive steps); the peak is the resident
memory of the run's whole process tree over its life (start-up, steps, final checkpoint).

The 4-worker point is *modelled* (this machine has 2 cores): its step is the measured
1-worker `rollout launch` step with the generation phase swapped for the generation time of
one worker's share of the prompts measured alone (a `rollout run` of that share on one core),
plus the weight-sync time extrapolated linearly in the worker count from the measured 1- and
2-worker syncs (the relay chain adds one hop per worker). Its peak memory is the 1-worker peak
plus three times the measured cost of the second worker. The same model is evaluated at 1
and 2 workers, next to the measured runs, as a check.

Each axis gets a power-law fit, `y = c * x ** b` by least squares in log-log space, of the
step seconds and of the peak RSS (and of the peak above the import-torch floor of its
processes), with the raw points.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The runs live in bench/scaling_runs.py, the fits in bench/scaling_fit.py and the plot in
# bench/scaling_plot.py; this module runs the axes and writes the JSON and the docs.
from bench.distributed import cpu_model  # noqa: E402
from bench.scaling_fit import fits  # noqa: E402
from bench.scaling_plot import plot  # noqa: E402
from bench.scaling_runs import AXES, FULL, QUICK, ROLLOUT, Bench, Plan, axis_points, workers_points  # noqa: E402
from bench.sharding import import_torch_floor  # noqa: E402

RESULTS = REPO / "bench" / "results" / "scaling.json"
PLOT = REPO / "docs" / "scaling.png"
DOCS = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- scaling:begin -->", "<!-- scaling:end -->"
HEADING = "## Scaling: step time and memory against work"


def host() -> dict[str, Any]:
    import torch
    import transformers

    version = subprocess.run([str(ROLLOUT), "--version"], capture_output=True, text=True, check=False)
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "rollout": version.stdout.strip(),
        "torch_threads_per_process": 1,
    }


INTRO = """\
How a step's time and memory grow with the work asked of it, so that a larger run can be
sized before it starts. `bench/scaling` (`--quick`: a smoke run; `--axes length,group`: some
axes) moves one axis at a time away from a base workload: the model (~1M, ~25M, ~100M
parameters, untrained Llamas from `create_tiny_model`), the completion length (32 to 512
tokens), the group size (4 to 32) and the generation workers (1, 2, 4). The model axis runs
a lighter workload so that the 100M model's steps stay short, and the workers axis runs the
25M model, whose generation is compute-bound enough to gain from being split (the 1M model's
decode steps cost about the same for 8 rows as for 32). `rollout.ignore_eos = true` makes
every completion exactly its budget, so an untrained model does exactly the work asked; the
reward is a coin flip and advantages are normalised over the step, so every row trains.
Every process runs one torch thread (a worker is one core). Each point is one run: a warm-up
step, then the median of the measured steps (wall time between the ends of consecutive
steps). The peak is the resident memory of the run's whole process tree, start-up to final
checkpoint; "above the floor" subtracts, once per Python process, the peak of a Python that
has only imported torch. Updates are packed into micro-batches of at most 4096 tokens, so
activation memory stops growing once a step fills several of them. "CPU s per s" is the CPU
time the run's processes got per second of its wall time: a one-process run wants 1; less
means other work on the machine took the core.

**Measured and modelled.** The model, length and group points and the 1- and 2-worker points
(`rollout launch`, one trainer, `max_staleness = 0`) are measured. This machine has 2 cores,
so 4 workers cannot each have their own: that point is **modelled** from measured parts, the
1-worker `rollout launch` step with its generation phase replaced by the generation time of
one worker's share of the prompts measured alone (a one-process run of that share on one
core; the workers run in parallel, so the step waits for one share), plus the weight sync
extrapolated linearly from the 1- and 2-worker syncs (the relay chain adds a hop per
worker). Its memory is the 1-worker peak plus three times the measured cost of the second
worker. The model assumes a core per worker, so it is the best case; the JSON
(`bench/results/scaling.json`, `axes.workers.model`) also evaluates it at 1 and 2 workers
next to the measured runs.

**Predicting a larger run.** Each axis is fitted with `y = c * x^b` (least squares on the
logs). Scaling one axis by a factor `k` multiplies the step time by about `k^b`; moving
several axes multiplies their factors (this assumes they act independently, which holds
roughly while one phase dominates). For memory use the above-floor exponent on the part above
the floor: `peak ~ floor * processes + (peak - floor * processes) * k^b`. Use the last-segment
exponent when extrapolating upward: fixed costs (Python, kernel launches, the engine's
per-step work) flatten the low end of each axis, while what dominates at the top (attention
over longer contexts, larger matrix multiplies) keeps growing. The exponents hold for this
machine and these shapes, and the machine is shared: two full runs minutes apart differed
by up to about 0.25 in a step-time exponent, so read them to one decimal.

![Step time and peak memory against each axis, log-log](scaling.png)
"""


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def exponent(fit: dict[str, Any] | None) -> str:
    if not fit:
        return "-"
    if fit["points"] <= 2:
        return f"{fit['exponent']:.2f}"
    return f"{fit['exponent']:.2f} (last {fit['last_segment_exponent']:.2f})"


def markdown(results: dict[str, Any]) -> str:
    h = results["host"]
    lines = [
        f"Measured {results['date']} with `{results['command']}` in {results['wall_seconds'] / 60:.1f} min "
        f"({h['cpu_model']}, {h['cpu_count']} CPUs; torch {h['torch']}, one torch thread per process; "
        f"import-torch floor {mib(results['import_torch_rss_bytes'])} MiB)"
        + (", **a quick smoke run** (one measured step per point)." if results["quick"] else "."),
        "",
        *fit_table(results),
        "",
        *points_table(results),
        *workers_notes(results),
        *length_example(results),
    ]
    return "\n".join(lines)


def fit_table(results: dict[str, Any]) -> list[str]:
    """Each axis's base workload and exponents."""
    lines = [
        "| axis | base workload (model, prompts x group, tokens) | step-time exponent (last segment) "
        "| peak-RSS exponent | above-floor exponent |",
        "|---|---|---|---|---|",
    ]
    for axis in AXES:
        if axis not in results["axes"]:
            continue
        data = results["axes"][axis]
        base = data["base"]
        fit = data["fit"]
        lines.append(
            f"| {axis} | {base['model']}, {base['prompts']} x {base['group']}, {base['length']} "
            f"| {exponent(fit['step_seconds'])} | {exponent(fit.get('peak_rss'))} "
            f"| {exponent(fit.get('peak_rss_above_floor'))} |"
        )
    return lines


def points_table(results: dict[str, Any]) -> list[str]:
    """Every point of every axis: step and phase seconds, peak RSS, CPU share, measured or modelled."""
    lines = [
        "| axis | value | step s | generate s | train s | sync s | peak RSS MiB | CPU s per s | |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for axis in AXES:
        if axis not in results["axes"]:
            continue
        for p in results["axes"][axis]["points"]:
            phases = p.get("phase_seconds")

            def phase(name: str, phases: dict[str, float] | None = phases) -> str:
                return "-" if phases is None else f"{phases[name]:.2f}"

            value = f"{p['x'] / 1e6:.1f}M" if axis == "model" else p["label"]
            cpu = f"{p['cpu_per_wall']:.2f}" if "cpu_per_wall" in p else "-"
            lines.append(
                f"| {axis} | {value} | {p['step_seconds']:.2f} | {phase('generate')} | {phase('train')} "
                f"| {phase('sync')} | {mib(p.get('peak_rss_bytes'))} | {cpu} "
                f"| {p['kind']} |"
            )
    return lines


def workers_notes(results: dict[str, Any]) -> list[str]:
    """The worker model against the measured runs, and the CPU the crowded runs got."""
    workers = results["axes"].get("workers")
    if not workers:
        return []
    lines: list[str] = []
    checks = ", ".join(
        f"{w} workers: modelled {c['modelled_step_seconds']:.2f} s, measured "
        f"{c['measured_step_seconds']:.2f} s ({c['error']:+.0%})"
        for w, c in workers["model"]["check"].items()
        if w != "1"
    )
    if checks:
        lines += [
            "",
            f"The worker model (anchored on the measured 1-worker run) against a measured run: {checks}.",
        ]
    own = workers["model"]["own_core_step_seconds"]
    lines += [
        "",
        "With every worker on a core of its own (the model at "
        + ", ".join(f"{w} worker{'s' if w != '1' else ''}: {s:.2f} s" for w, s in own.items())
        + f"), the step-time exponent is {workers['model']['own_core_fit']['exponent']:.2f}: "
        "only the generation phase is split, the trainer's phase and the sync are not.",
    ]
    crowded = [p for p in workers["points"] if p["kind"] == "measured" and p["x"] > 1]
    lines += [
        f"The measured {p['x']}-worker run got {p['cpu_per_wall']:.2f} CPU seconds per second for "
        f"{p['x']} workers and a trainer on {results['host']['cpu_count']} shared cores."
        for p in crowded
        if "cpu_per_wall" in p
    ]
    return lines


def length_example(results: dict[str, Any]) -> list[str]:
    """A prediction from the length axis's last-segment exponent."""
    length = results["axes"].get("length")
    if not length:
        return []
    last = length["points"][-1]
    b = length["fit"]["step_seconds"]["last_segment_exponent"]
    return [
        "",
        f"Example: doubling the completion budget from {last['label']} to {2 * last['x']} tokens "
        f"predicts about {last['step_seconds']:.1f} s x 2^{b:.2f} = "
        f"{last['step_seconds'] * 2**b:.1f} s per step for this workload.",
    ]


def write_docs(results: dict[str, Any]) -> None:
    block = f"{BEGIN}\n{markdown(results)}\n{END}"
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + f"\n\n{HEADING}\n\n{INTRO}\n{block}\n"
    DOCS.write_text(text)


METHOD = {
    "step_seconds": "median over the measured steps of the wall time between consecutive step ends",
    "peak_rss_bytes": "peak resident memory of the run's process tree over its whole life "
    "(bench/e2e/processes.py: polled tree sum and per-process VmHWM)",
    "peak_rss_above_floor": "peak_rss_bytes - python_processes * import_torch_rss_bytes",
    "fit": "y = coefficient * x ** exponent, least squares on log x, log y; "
    "last_segment_exponent: the slope between the two largest points",
    "workload": "ignore_eos (every completion is exactly its budget), Format reward "
    "(a coin flip for the untrained model), batch_norm advantages (every row trains), "
    "one torch thread per process, micro_batch_tokens 4096, fp32",
    "measured": "every point of the model, length and group axes; workers 1 and 2 "
    "(rollout launch, 1 trainer, max_staleness 0)",
    "modelled": "workers 4: see axes.workers.model",
}


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments, and the axes to run (in the order given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "bench" / ".work" / "scaling")
    parser.add_argument(
        "--quick", action="store_true", help="two points per axis, 2 steps each (a smoke run)"
    )
    parser.add_argument("--axes", default=",".join(AXES), help=f"comma-separated subset of {','.join(AXES)}")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args(argv)
    axes = [a.strip() for a in args.axes.split(",") if a.strip()]
    unknown = sorted(set(axes) - set(AXES))
    if unknown:
        parser.error(f"unknown axes {unknown}; choose from {', '.join(AXES)}")
    return args, axes


def measure_axes(bench: Bench, axes: Sequence[str], floor: int) -> dict[str, Any]:
    """The points and fits of each axis asked for, in the order of :data:`AXES`."""
    plan = bench.plan
    measured_axes: dict[str, Any] = {}
    for axis in (a for a in AXES if a in axes):
        print(f"{axis} axis: {plan.values[axis]}", flush=True)
        extra: dict[str, Any] = {}
        if axis == "workers":
            points, extra["model"] = workers_points(bench)
        else:
            points = axis_points(bench, axis)
        measured_axes[axis] = {
            "values": plan.values[axis],
            "base": dataclasses.asdict(plan.bases[axis]),
            "points": points,
            "fit": fits(points, floor),
            **extra,
        }
        fit = measured_axes[axis]["fit"]
        print(
            f"  exponents: step time {fit['step_seconds']['exponent']:.2f}, "
            f"peak RSS {fit['peak_rss']['exponent'] if 'peak_rss' in fit else float('nan'):.2f}",
            flush=True,
        )
    return measured_axes


def collect_results(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    plan: Plan,
    measured_axes: dict[str, Any],
    floor: int,
    started: float,
    load_before: tuple[float, float, float],
) -> dict[str, Any]:
    """The JSON written to :data:`RESULTS`; axes not run this time keep their last results
    (from a run of the same mode)."""
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    kept = previous.get("axes", {}) if previous.get("quick") == args.quick else {}
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": "bench/scaling" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "quick": args.quick,
        "host": host(),
        "load_average_1min": {"start": load_before[0], "end": os.getloadavg()[0]},
        "wall_seconds": round(time.perf_counter() - started, 1),
        "warmup_steps": plan.warmup,
        "measured_steps_per_point": plan.measured,
        "import_torch_rss_bytes": floor,
        "method": METHOD,
        "axes": {**{k: v for k, v in kept.items() if k not in measured_axes}, **measured_axes},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args, axes = parse_args(argv)
    if not ROLLOUT.exists():
        raise SystemExit(f"{ROLLOUT} is missing: build it (bench/scaling does)")
    plan = QUICK if args.quick else FULL
    work: Path = args.work
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    started = time.perf_counter()
    load_before = os.getloadavg()
    bench = Bench(work, plan)
    floor = import_torch_floor()
    measured_axes = measure_axes(bench, axes, floor)
    results = collect_results(args, argv, plan, measured_axes, floor, started, load_before)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    plotted = plot(results, PLOT)
    if not args.no_docs:
        write_docs(results)
    summary = {
        axis: {
            "step_seconds_exponent": round(data["fit"]["step_seconds"]["exponent"], 3),
            "peak_rss_exponent": round(data["fit"]["peak_rss"]["exponent"], 3)
            if "peak_rss" in data["fit"]
            else None,
        }
        for axis, data in results["axes"].items()
    }
    print(json.dumps({"wall_seconds": results["wall_seconds"], "exponents": summary}, indent=2))
    written = [RESULTS] + ([PLOT] if plotted else [])
    print("wrote " + ", ".join(str(path.relative_to(REPO)) for path in written), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
