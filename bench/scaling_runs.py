"""``bench/scaling``'s measurements: the workloads and plans, one run per distinct workload,
and the points of each axis (the 4-worker point modelled from measured parts)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.distributed import base_config
from bench.e2e import REPO
from bench.e2e.processes import run_measured
from bench.e2e.runs import SIZES, write_toml
from bench.scaling_fit import power_law
from bench.sharding import MODEL as SHARDING_MODEL
from bench.sharding import parameter_count
from python_plugins.quickstart import create_tiny_model, write_addition_splits

ROLLOUT = REPO / "target" / "release" / "rollout"
AXES = ("model", "length", "group", "workers")
SHAPE = ("hidden_size", "num_layers", "num_heads", "intermediate_size")
MODELS: dict[str, dict[str, int]] = {
    "1M": {key: getattr(SIZES["tiny"], key) for key in SHAPE},
    "25M": {key: getattr(SIZES["small"], key) for key in SHAPE},
    "100M": dict(SHARDING_MODEL),
}
# Room for the prompt and the longest completion budget (RoPE: no parameters depend on it).
MAX_POSITIONS = 1024
# The completion starts with a digit or one of a-m: about 40% of an untrained model's samples.
REWARD = {
    "plugin": "python_plugins.rewards:Format",
    "options": {"pattern": "(?s)[0-9a-m].*", "require_stop": False},
}


@dataclasses.dataclass(frozen=True)
class Workload:
    model: str
    prompts: int
    group: int
    length: int
    # None: one process (`rollout run`); a number: `rollout launch` with that many workers.
    workers: int | None = None

    @property
    def label(self) -> str:
        where = "run" if self.workers is None else f"launch{self.workers}w"
        return f"{self.model}-p{self.prompts}-g{self.group}-l{self.length}-{where}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The axes' values and base workloads, and the steps of each run."""

    values: dict[str, list[Any]]
    bases: dict[str, Workload]
    warmup: int
    measured: int


FULL = Plan(
    values={
        "model": ["1M", "25M", "100M"],
        "length": [32, 64, 128, 256, 512],
        "group": [4, 8, 16, 32],
        "workers": [1, 2, 4],
    },
    bases={
        # The 100M model on a lighter workload, so that its steps stay short on a CPU core.
        "model": Workload("1M", prompts=4, group=4, length=32),
        "length": Workload("1M", prompts=4, group=8, length=64),
        "group": Workload("1M", prompts=4, group=8, length=64),
        # The 25M model: the 1M model's decode steps cost about the same for 8 rows as for 32
        # (fixed per-step costs), so splitting its prompts over workers saves little.
        "workers": Workload("25M", prompts=4, group=8, length=64),
    },
    warmup=1,
    measured=4,
)
QUICK_BASE = Workload("1M", prompts=4, group=4, length=32)
QUICK = Plan(
    values={"model": ["1M", "25M"], "length": [32, 64], "group": [4, 8], "workers": [1, 2, 4]},
    bases=dict.fromkeys(AXES, QUICK_BASE),
    warmup=1,
    measured=1,
)


class Bench:
    """The runs of one campaign; each distinct workload is measured once and shared by the axes."""

    def __init__(self, work: Path, plan: Plan) -> None:
        self.work = work
        self.plan = plan
        self.cache: dict[Workload, dict[str, Any]] = {}
        self.models: dict[str, Path] = {}
        self.data, _ = write_addition_splits(work / "data", train=2000, test=16, seed=0)

    def model(self, name: str) -> Path:
        if name not in self.models:
            path = self.work / "models" / name
            create_tiny_model(path, max_positions=MAX_POSITIONS, seed=0, **MODELS[name])
            self.models[name] = path
        return self.models[name]

    def measure(self, workload: Workload) -> dict[str, Any]:
        if workload in self.cache:
            return self.cache[workload]
        run_dir = self.work / "runs" / workload.label
        path = self.write_config(workload, run_dir)
        command = "run" if workload.workers is None else "launch"
        started, load, cpu = time.perf_counter(), os.getloadavg()[0], children_cpu_seconds()
        measured = run_measured(
            [str(ROLLOUT), command, str(path), "--overwrite"], self.work / "logs" / f"{workload.label}.log"
        )
        wall = time.perf_counter() - started
        cpu = children_cpu_seconds() - cpu
        steps_read = read_steps(run_dir / "metrics.jsonl")[self.plan.warmup :]
        # The final checkpoint (written after the last step, inside the measured peak) is not needed.
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        if not steps_read:
            raise SystemExit(f"{workload.label}: no steps after the warm-up")
        tokens = {s["generated_tokens"] / s["completions"] for s in steps_read}
        if tokens != {workload.length}:
            print(f"  warning: {workload.label}: tokens per completion {sorted(tokens)}", flush=True)
        processes = 1 if workload.workers is None else workload.workers + 1
        result = {
            "workload": dataclasses.asdict(workload),
            "command": f"rollout {command}",
            **step_figures(steps_read),
            "peak_rss_bytes": measured["peak_rss_bytes"],
            "python_processes": processes,
            "run_wall_seconds": round(wall, 1),
            # CPU seconds the run's processes got over its wall time: well below the process
            # count while other work shares the cores.
            "run_cpu_seconds": round(cpu, 1),
            "cpu_per_wall": round(cpu / wall, 2),
            "load_average_1min": round((load + os.getloadavg()[0]) / 2, 2),
        }
        print(
            f"  {workload.label}: {result['step_seconds']:.2f} s/step "
            f"(generate {result['phase_seconds']['generate']:.2f}, "
            f"train {result['phase_seconds']['train']:.2f}), "
            f"peak {result['peak_rss_bytes'] / 2**20:.0f} MiB, run {result['run_wall_seconds']:.0f} s",
            flush=True,
        )
        self.cache[workload] = result
        return result

    def write_config(self, workload: Workload, run_dir: Path) -> Path:
        """The run's config, written under ``configs/`` (the model is created on first use)."""
        model = self.model(workload.model)
        steps = self.plan.warmup + self.plan.measured
        cluster = {} if workload.workers is None else {"workers": workload.workers, "trainers": 1}
        config = base_config(
            model,
            self.data,
            run={"name": "bench-scaling", "steps": steps, "output_dir": str(run_dir)},
            rollout={
                "prompts_per_step": workload.prompts,
                "group_size": workload.group,
                "max_new_tokens": workload.length,
                "ignore_eos": True,
                "temperature": 1.0,
            },
            algorithm={"advantage": "batch_norm"},
            **{"[]rewards": REWARD},
            **({"cluster": {**cluster, "max_staleness": 0}} if cluster else {}),
        )
        path = self.work / "configs" / f"{workload.label}.toml"
        write_toml(path, config)
        return path


PHASES = ("generate", "score", "train", "sync", "other")


def read_steps(path: Path) -> list[dict[str, float]]:
    """Each step's wall seconds (end of the previous step to its end) and its phases."""
    steps = []
    previous = 0.0
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "step" not in record or record.get("summary"):
            continue
        wall = record["elapsed_seconds"] - previous
        previous = record["elapsed_seconds"]
        phases = {
            "generate": record["generate_seconds"],
            "score": record["score_seconds"],
            "train": record["train_seconds"],
            "sync": record.get("weight_sync_seconds", 0.0),
        }
        phases["other"] = wall - sum(phases.values())
        steps.append(
            {
                "step_seconds": wall,
                "completions": record["completions"],
                "generated_tokens": record["generated_tokens"],
                **{f"{name}_seconds": value for name, value in phases.items()},
            }
        )
    return steps


def children_cpu_seconds() -> float:
    """User and system CPU seconds of this process's finished (waited-for) descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def step_figures(steps: Sequence[dict[str, float]]) -> dict[str, Any]:
    """The measured steps' medians (step seconds, phases) and mean tokens per completion."""
    return {
        "measured_steps": len(steps),
        "step_seconds": median(s["step_seconds"] for s in steps),
        "step_seconds_all": [round(s["step_seconds"], 4) for s in steps],
        "phase_seconds": {p: median(s[f"{p}_seconds"] for s in steps) for p in PHASES},
        "tokens_per_completion": statistics.fmean(s["generated_tokens"] / s["completions"] for s in steps),
    }


# The axes


def axis_points(bench: Bench, axis: str) -> list[dict[str, Any]]:
    base, values = bench.plan.bases[axis], bench.plan.values[axis]
    points = []
    for value in values:
        if axis == "model":
            result = bench.measure(dataclasses.replace(base, model=value))
            x = parameter_count(bench.model(value))
        elif axis == "length":
            result, x = bench.measure(dataclasses.replace(base, length=value)), value
        elif axis == "group":
            result, x = bench.measure(dataclasses.replace(base, group=value)), value
        else:
            continue
        points.append({"x": x, "label": str(value), "kind": "measured", **result})
    return points


@dataclasses.dataclass(frozen=True)
class WorkerModel:
    """A `rollout launch` step with W workers, each on a core of its own, from measured parts.

    The measured 1-worker step, with its generation phase swapped for one worker's share of
    the prompts generated alone, and its sync extrapolated linearly from the 1- and 2-worker
    syncs; its peak is the 1-worker peak plus the second worker's measured cost per worker.
    """

    launched: dict[int, dict[str, Any]]  # `rollout launch` runs, by worker count
    shares: dict[int, int]  # prompts per worker, by worker count
    alone: dict[int, float]  # generate seconds of that many prompts in a one-process run

    @property
    def one(self) -> dict[str, Any]:
        return self.launched[1]

    @property
    def sync(self) -> dict[int, float]:
        return {w: self.launched[w]["phase_seconds"]["sync"] for w in self.launched}

    @property
    def sync_per_worker(self) -> float:
        return self.sync[2] - self.sync[1] if 2 in self.sync else 0.0

    @property
    def memory_per_worker(self) -> int | None:
        if 2 not in self.launched:
            return None
        return self.launched[2]["peak_rss_bytes"] - self.one["peak_rss_bytes"]

    def phases(self, w: int) -> dict[str, float]:
        phases = dict(self.one["phase_seconds"])
        phases["generate"] += self.alone[self.shares[w]] - self.alone[self.shares[1]]
        phases["sync"] += (w - 1) * max(self.sync_per_worker, 0.0)
        return phases

    def step_seconds(self, w: int) -> float:
        phases = self.phases(w)
        changed = ("generate", "sync")
        return self.one["step_seconds"] + sum(phases[p] - self.one["phase_seconds"][p] for p in changed)

    def peak(self, w: int) -> int | None:
        memory_per_worker = self.memory_per_worker
        if memory_per_worker is None:
            return None
        return self.one["peak_rss_bytes"] + (w - 1) * memory_per_worker

    def report(self, counts: Sequence[int]) -> dict[str, Any]:
        """The model, its parts and its check against the measured runs (``axes.workers.model``)."""
        return {
            "description": (
                "step(W) = the measured 1-worker launch step's phases (medians), with generate "
                "+= generate(ceil(P/W) prompts alone) - generate(P prompts alone) (the workers run "
                "in parallel on equal shares, so the step waits for one share) and sync += (W - 1) * "
                "(sync(2 workers) - sync(1 worker)); "
                "peak(W) = peak(1 worker) + (W - 1) * (peak(2 workers) - peak(1 worker)). "
                "'alone' = the generate phase of a one-process `rollout run` of that many prompts "
                "on one core, i.e. a worker with its own core."
            ),
            "measured": sorted(self.launched),
            "modelled": [w for w in counts if w not in self.launched],
            "prompts_per_worker": {str(w): self.shares[w] for w in counts},
            "generate_seconds_alone": {str(k): v for k, v in self.alone.items()},
            "sync_seconds_measured": {str(k): v for k, v in self.sync.items()},
            "sync_seconds_per_extra_worker": self.sync_per_worker,
            "peak_rss_bytes_per_extra_worker": self.memory_per_worker,
            "check": {
                str(w): {
                    "measured_step_seconds": self.launched[w]["step_seconds"],
                    "modelled_step_seconds": self.step_seconds(w),
                    "error": self.step_seconds(w) / self.launched[w]["step_seconds"] - 1,
                }
                for w in self.launched
            },
            # The whole axis as the model sees it: every worker on a core of its own.
            "own_core_step_seconds": {str(w): self.step_seconds(w) for w in counts},
            "own_core_fit": power_law(counts, [self.step_seconds(w) for w in counts]),
        }


def workers_points(bench: Bench) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """1 and 2 workers measured under `rollout launch`; 4 modelled from measured components."""
    base = bench.plan.bases["workers"]
    counts = bench.plan.values["workers"]
    real = [w for w in counts if w <= max(1, min(2, os.cpu_count() or 1))]
    launched = {w: bench.measure(dataclasses.replace(base, workers=w)) for w in real}
    # One worker's share of a step, generated alone by one process on one core.
    shares = {w: math.ceil(base.prompts / w) for w in counts}
    alone = {
        share: bench.measure(dataclasses.replace(base, prompts=share))["phase_seconds"]["generate"]
        for share in sorted(set(shares.values()))
    }
    model = WorkerModel(launched, shares, alone)
    points = []
    for w in counts:
        if w in launched:
            point = {"x": w, "label": str(w), "kind": "measured", **launched[w]}
        else:
            point = {
                "x": w,
                "label": str(w),
                "kind": "modelled",
                "workload": dataclasses.asdict(dataclasses.replace(base, workers=w)),
                "step_seconds": model.step_seconds(w),
                "phase_seconds": model.phases(w),
                "peak_rss_bytes": model.peak(w),
                "python_processes": w + 1,
            }
        point["modelled_step_seconds"] = model.step_seconds(w)
        points.append(point)
    return points, model.report(counts)
