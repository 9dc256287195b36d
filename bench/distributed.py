"""Distributed Rollout benchmark: weight sync, asynchronous vs synchronous RL, controller capacity.

Writes bench/results/distributed.json. Run `bench/distributed` (it sets up the environment).

- Weight sync of the ~25M model (the `small` model of bench/e2e) to 1, 2 and 4 workers over
  loopback: the transport alone (examples/weight_sync.rs: trainer store -> relay chain of
  worker stores, against raw loopback TCP measured between the syncs; once with the version
  filled before the pull, once filled by the trainer's own copy while it is pulled), and end to end in a real
  `rollout launch` (export from torch, buckets, relay, verify, import into torch).
- Asynchronous (max_staleness 1) vs synchronous (0) completions/s with the same processes on a
  heavy-tailed completion-length workload, and the learning curves of both from one checkpoint.
- Where each sync's CPU goes, from a system-wide `perf` profile of the launch (bench/sync_cpu.py).
- Controller capacity with simulated generation workers (examples/controller_capacity.rs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import sync_cpu  # noqa: E402
from bench.e2e.report import learning_verdict  # noqa: E402
from bench.e2e.runs import SIZES, write_toml  # noqa: E402
from bench.hosts import carry_other_hosts  # noqa: E402
from python_plugins.quickstart import (  # noqa: E402
    QUICKSTART_MODEL,
    TEST_EXAMPLES,
    TRAIN_EXAMPLES,
    create_tiny_model,
    write_addition_splits,
)

RESULTS = REPO / "bench" / "results" / "distributed.json"
ROLLOUT = REPO / "target" / "release" / "rollout"
EXAMPLES = REPO / "target" / "release" / "examples"
WORKER_COUNTS = (1, 2, 4)
BUCKET_BYTES = 8 << 20
# The raw relay chain that moves the model's own bytes and keeps them, as a sync must.
KEPT_CHAIN = "raw_relay_chain_kept_bytes_per_second"
# That chain with each relay forwarding whole buckets (BUCKET_BYTES), as a weight store does,
# instead of each read as it arrives.
BUCKETED_CHAIN = "raw_relay_chain_bucketed_bytes_per_second"
# A sync the next step waits for whole: `weight_sync_seconds` is the whole sync.
WHOLE_SYNC = {"trainers": 1, "max_staleness": 0}
# The cluster users run: configs/distributed.toml's (2 workers, 2 trainer ranks, staleness 1).
SHIPPED_SYNC: dict[str, Any] = tomllib.loads((REPO / "configs" / "distributed.toml").read_text())["cluster"]


def cargo_example(name: str) -> Path:
    env = {**os.environ, "PYO3_PYTHON": sys.executable}
    subprocess.run(
        ["cargo", "build", "--release", "--quiet", "-p", "rollout-core", "--example", name],
        cwd=REPO,
        env=env,
        check=True,
    )
    return EXAMPLES / name


def launch(
    config: Path,
    *overrides: str,
    timeout: float = 1800,
    trace: Path | None = None,
    under: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """`rollout launch config` with `--set overrides`, run under the command `under` if given
    (a profiler): the lines of its metrics.jsonl."""
    args = [*under, str(ROLLOUT), "launch", str(config), "--overwrite"]
    if trace is not None:
        args += ["--trace", str(trace)]
    for override in overrides:
        args += ["--set", override]
    output_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("run.output_dir="))
    log = Path(output_dir).with_suffix(".log")
    with log.open("w") as out:
        subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=timeout, cwd=REPO)
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def policy(model: Path, threads: int = 1) -> dict[str, Any]:
    return {
        "plugin": "python_plugins.hf_policy:HFCausalLM",
        "options": {"model_path": str(model), "torch_threads": threads},
    }


def base_config(model: Path, data: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "run": {"name": "bench-distributed", "seed": 0},
        "policy": policy(model),
        "data": {
            "plugin": "python_plugins.data:JsonlPrompts",
            "options": {"path": str(data), "template": "{question}"},
        },
        "[]rewards": {"plugin": "python_plugins.rewards:ExactMatch"},
        "train": {"learning_rate": 5e-5, "micro_batch_tokens": 4096},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


# Weight sync


def sync_layout(work: Path, small: Path) -> Path:
    """The small model's trainable tensors as `[[name, shape], ...]`, the transport benchmark's input."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(small)
    layout = [[name, list(p.shape)] for name, p in model.named_parameters() if p.requires_grad]
    path = work / "small-layout.json"
    path.write_text(json.dumps(layout))
    return path


def weight_sync_transport(binary: Path, layout: Path, workers: int, repeats: int) -> dict[str, Any]:
    """The transport alone to `workers` workers, with raw loopback TCP measured between its syncs."""
    result = subprocess.run(
        [str(binary), str(layout), str(BUCKET_BYTES), str(repeats), str(workers)],
        capture_output=True,
        text=True,
        check=True,
    )
    print(result.stderr, end="", flush=True)
    return json.loads(result.stdout)["transport"][0]


def span_seconds(trace: Path) -> dict[str, list[float]]:
    """Seconds of each weight-sync span in a merged `--trace` file: the trainer's export (until
    the version is reported) and fill (its buckets copied while workers pull them), each
    worker's connect and pull, and its import (which takes buckets as the pull brings them)."""
    events = json.loads(trace.read_text())["traceEvents"]
    names = {"weights.export", "weights.fill", "weights.connect", "weights.pull", "weights.import"}
    begun: dict[tuple[Any, Any, str], float] = {}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for event in events:
        name = event.get("name")
        if name not in names or event.get("ph") not in ("b", "e"):
            continue
        key = (event["pid"], event.get("id"), name)
        if event["ph"] == "b":
            begun[key] = event["ts"]
        elif key in begun:
            seconds[name].append((event["ts"] - begun.pop(key)) / 1e6)
    return seconds


def weight_sync_end_to_end(
    work: Path,
    small: Path,
    data: Path,
    workers: int,
    steps: int,
    tag: str,
    cluster: dict[str, Any],
    under: Sequence[str] = (),
) -> dict[str, Any]:
    """A real `rollout launch` (under `under`, if given) syncing after every step, with
    `cluster`'s trainers and staleness: the median `weight_sync_seconds` (the first sync left
    out) and the median of each weight-sync span of its trace, which it leaves at
    `sync_trace(work, tag)`."""
    config = work / f"sync-{tag}.toml"
    write_toml(
        config,
        base_config(
            small,
            data,
            run={"steps": steps},
            rollout={"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8},
            cluster={**cluster, "workers": workers, "weight_bucket_bytes": BUCKET_BYTES},
        ),
    )
    trace = sync_trace(work, tag)
    lines = launch(config, f"run.output_dir={work / f'sync-{tag}'}", trace=trace, under=under)
    seconds = [line["weight_sync_seconds"] for line in lines[1:]]
    spans = {name: statistics.median(values) for name, values in span_seconds(trace).items() if values}
    print(f"  end to end, {workers} workers: {statistics.median(seconds):.3f} s per sync {spans}", flush=True)
    return {"seconds": seconds, "seconds_median": statistics.median(seconds), "span_seconds_median": spans}


def sync_trace(work: Path, tag: str) -> Path:
    return work / f"sync-{tag}.trace.json"


@dataclass(frozen=True)
class SyncBench:
    """Syncs of the small model, each measured around its launch: the transport benchmark
    (`binary` on the model's `layout`, with its raw chains), the launch, and the transport
    benchmark again, so the raw chain a sync is divided by was measured on the host as it
    was during that sync."""

    work: Path
    small: Path
    data: Path
    binary: Path
    layout: Path
    repeats: int
    steps: int

    def around_launch(
        self, workers: int, tag: str, cluster: dict[str, Any], under: Sequence[str] = ()
    ) -> dict[str, Any]:
        before = weight_sync_transport(self.binary, self.layout, workers, self.repeats)
        end_to_end = weight_sync_end_to_end(
            self.work, self.small, self.data, workers, self.steps, tag, cluster, under
        )
        after = weight_sync_transport(self.binary, self.layout, workers, self.repeats)
        return {"workers": workers, "transport": [before, after], "end_to_end": end_to_end}

    def rounds(self, rounds: int) -> list[dict[str, Any]]:
        """Each round, each worker count (in alternating order from round to round) with a
        sync the next step waits for whole (`WHOLE_SYNC`)."""
        measured = []
        for round_ in range(rounds):
            order = WORKER_COUNTS if round_ % 2 == 0 else tuple(reversed(WORKER_COUNTS))
            for workers in order:
                m = self.around_launch(workers, f"{workers}-{round_}", WHOLE_SYNC)
                measured.append(with_fractions({"round": round_, **m}))
        return measured

    def profiled(self, workers: int, cores: int) -> dict[str, Any]:
        """A round at `workers` with its launch under a system-wide `perf record`: the
        measurement, where its syncs' CPU went (bench/sync_cpu.py), and the raw chain's seconds
        over the shortest sync that much CPU allows on `cores`."""
        tag = f"profile-{workers}"
        samples = self.work / f"{tag}.perf.data"
        m = with_fractions(
            self.around_launch(workers, tag, WHOLE_SYNC, under=sync_cpu.record_command(samples))
        )
        cpu = sync_cpu.profile(samples, sync_trace(self.work, tag), cores)
        samples.unlink()
        print(
            f"  {workers} workers: {cpu['cpu_seconds_per_sync']:.3f} CPU s per sync on {cores} cores, "
            f"{cpu['busy_cores']:.2f} busy, {cpu['by_work']}",
            flush=True,
        )
        bound = raw_chain_seconds(m) / cpu["cpu_bound_seconds"] if cpu["cpu_bound_seconds"] else 0.0
        return {**m, "cpu": cpu, "cpu_bound_fraction_of_raw_chain": bound}

    def shipped(self) -> dict[str, Any]:
        """The sync with `configs/distributed.toml`'s cluster settings (`SHIPPED_SYNC`). With
        staleness the load goes on into the next step, so the figure is the workers' pull span
        (transfer and verification) against the raw chain."""
        m = self.around_launch(SHIPPED_SYNC["workers"], "shipped", SHIPPED_SYNC)
        pull = m["end_to_end"]["span_seconds_median"]["weights.pull"]
        return {**m, "cluster": SHIPPED_SYNC, "pull_fraction_of_raw_chain": raw_chain_seconds(m) / pull}


def fraction_of_raw_chain(
    measurement: dict[str, Any], rate: str = "raw_relay_chain_bytes_per_second"
) -> float:
    """The raw relay chain's seconds for the model's bytes over the end-to-end sync's median
    seconds."""
    return raw_chain_seconds(measurement, rate) / measurement["end_to_end"]["seconds_median"]


def raw_chain_seconds(measurement: dict[str, Any], rate: str = "raw_relay_chain_bytes_per_second") -> float:
    """The raw relay chain's seconds for the model's bytes (`rate` names which chain): the mean
    of the runs right before and right after the sync's launch."""
    return statistics.mean(t["model_bytes"] / t[rate] for t in measurement["transport"])


def with_fractions(measurement: dict[str, Any]) -> dict[str, Any]:
    """The measurement with its end-to-end sync's fractions of the raw chain, of the chain
    that keeps the model's bytes, and of that chain relaying whole buckets."""
    return {
        **measurement,
        "fraction_of_raw_chain": fraction_of_raw_chain(measurement),
        "fraction_of_raw_chain_kept": fraction_of_raw_chain(measurement, rate=KEPT_CHAIN),
        "fraction_of_raw_chain_bucketed": fraction_of_raw_chain(measurement, rate=BUCKETED_CHAIN),
    }


def per_worker_count(measured: Sequence[dict[str, Any]], key: str) -> dict[str, float]:
    """For each worker count, the median of its measurements' `key`."""
    return {
        str(workers): statistics.median(m[key] for m in measured if m["workers"] == workers)
        for workers in WORKER_COUNTS
    }


def transport_median(measured: Sequence[dict[str, Any]], key: str) -> dict[str, float]:
    """For each worker count, the median of the transport runs' `key`."""
    return {
        str(workers): statistics.median(
            t[key] for m in measured if m["workers"] == workers for t in m["transport"]
        )
        for workers in WORKER_COUNTS
    }


def step_time_tail(work: Path, steps: int) -> dict[str, Any]:
    """`rollout launch configs/distributed.toml` as shipped (its own warm start included): how
    the slowest 1% of steps compare with the median step."""
    config = REPO / "configs" / "distributed.toml"
    # Its model and data are the quickstart's, as after the README's first command.
    subprocess.run(
        [str(ROLLOUT), "init-quickstart", "--dir", "artifacts/quickstart"],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    lines = launch(config, f"run.output_dir={work / 'shipped'}", f"run.steps={steps}")
    seconds = sorted(line["step_seconds"] for line in lines)
    p99 = seconds[min(len(seconds) - 1, round(0.99 * (len(seconds) - 1)))]
    median = statistics.median(seconds)
    print(f"  {steps} steps of configs/distributed.toml: median {median:.3f} s, p99 {p99:.3f} s", flush=True)
    return {"steps": steps, "median_seconds": median, "p99_seconds": p99, "p99_over_median": p99 / median}


def sync_results(measured: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The headline figures of the weight-sync rounds, each the median over a worker count's
    measurements."""
    return {
        "weight_sync_fraction_of_loopback": transport_median(measured, "fraction_of_loopback")["4"],
        "weight_sync_fraction_of_raw_relay_chain": transport_median(measured, "fraction_of_raw_relay_chain")[
            "4"
        ],
        "weight_sync_end_to_end_fraction_of_raw_chain": per_worker_count(measured, "fraction_of_raw_chain"),
        # Against raw sockets that move the model's own bytes and keep them, as a sync must: a
        # diagnostic beside the target's chain, whose reused 1 MiB buffers stay in cache.
        "weight_sync_end_to_end_fraction_of_raw_chain_kept": per_worker_count(
            measured, "fraction_of_raw_chain_kept"
        ),
        # And against those sockets relaying whole buckets as the weight stores do.
        "weight_sync_end_to_end_fraction_of_raw_chain_bucketed": per_worker_count(
            measured, "fraction_of_raw_chain_bucketed"
        ),
        "trainer_egress_per_model_bytes": transport_median(measured, "trainer_egress_per_model_bytes")["4"],
        "weight_sync_seconds": {
            str(w): statistics.median(
                m["end_to_end"]["seconds_median"] for m in measured if m["workers"] == w
            )
            for w in WORKER_COUNTS
        },
        "weight_sync_transport_seconds": transport_median(measured, "seconds_median"),
        # The transport with the trainer's bucket copy (`weights.fill`) running beside the pull,
        # as in a launch: what that copy costs the sync, with no Python in the way.
        "weight_sync_transport_while_filling_seconds": transport_median(
            measured, "while_filling_seconds_median"
        ),
        "weight_sync_transport_while_filling_fraction_of_raw_chain": transport_median(
            measured, "while_filling_fraction_of_raw_relay_chain"
        ),
        # And served from the tensors in place (no copy, each bucket hashed as it is sent), as a
        # trainer serves it now.
        "weight_sync_transport_in_place_seconds": transport_median(measured, "in_place_seconds_median"),
        "weight_sync_transport_in_place_fraction_of_raw_chain": transport_median(
            measured, "in_place_fraction_of_raw_relay_chain"
        ),
    }


# Asynchronous vs synchronous


def heavy_tailed_data(path: Path, source: Path, group_size: int, seed: int) -> Path:
    """The addition prompts with per-sample budgets from a Pareto tail (4 to 96 tokens)."""
    rng = random.Random(seed)
    lines = []
    for line in source.read_text().splitlines():
        record = json.loads(line)
        record["budget"] = [min(96, int(4 * rng.paretovariate(1.1))) for _ in range(group_size)]
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def completions_per_second(lines: Sequence[dict[str, Any]], warmup: int) -> float:
    steps = lines[warmup:]
    seconds = steps[-1]["elapsed_seconds"] - lines[warmup - 1]["elapsed_seconds"]
    return sum(line["completions"] for line in steps) / seconds


def async_throughput(work: Path, model: Path, data: Path, steps: int, repeats: int) -> dict[str, Any]:
    group = 8
    tailed = heavy_tailed_data(work / "heavy-tailed.jsonl", data, group, seed=1)
    runs: dict[str, list[float]] = {"sync": [], "async": []}
    for repeat in range(repeats):
        order = ("sync", "async") if repeat % 2 == 0 else ("async", "sync")
        for mode in order:
            config = work / f"throughput-{mode}.toml"
            write_toml(
                config,
                base_config(
                    model,
                    tailed,
                    run={"steps": steps},
                    rollout={
                        "prompts_per_step": 16,
                        "group_size": group,
                        "max_new_tokens": 96,
                        "max_new_tokens_field": "budget",
                        "ignore_eos": True,
                    },
                    cluster={"workers": 2, "trainers": 1, "max_staleness": 1 if mode == "async" else 0},
                ),
            )
            lines = launch(config, f"run.output_dir={work / f'throughput-{mode}'}")
            value = completions_per_second(lines, warmup=3)
            runs[mode].append(value)
            print(f"  {mode}: {value:.1f} completions/s", flush=True)
    sync, asynchronous = statistics.median(runs["sync"]), statistics.median(runs["async"])
    return {
        "sync_completions_per_second": runs["sync"],
        "async_completions_per_second": runs["async"],
        "speedup": asynchronous / sync,
    }


def async_learning(work: Path, model: Path, data: Path, steps: int) -> dict[str, Any]:
    curves = {}
    for mode, staleness in (("sync", 0), ("async", 1)):
        config = work / f"learning-{mode}.toml"
        write_toml(
            config,
            base_config(
                model,
                data,
                run={"steps": steps},
                rollout={"prompts_per_step": 32, "group_size": 8, "max_new_tokens": 6, "temperature": 1.0},
                cluster={"workers": 2, "trainers": 1, "max_staleness": staleness},
            ),
        )
        lines = launch(config, f"run.output_dir={work / f'learning-{mode}'}")
        curves[mode] = [line["reward_mean"] for line in lines]
        first, last = statistics.mean(curves[mode][:10]), statistics.mean(curves[mode][-10:])
        print(f"  learning {mode}: first 10 steps {first:.3f}, last 10 steps {last:.3f}", flush=True)
    verdict = learning_verdict(curves["async"], curves["sync"])
    # The shared verdict names its sides after the TRL benchmark: here async vs sync.
    halves = verdict.pop("second_half_reward")
    verdict["second_half_reward"] = {"async": halves["rollout"], "sync": halves["trl"]}
    return {"curves": curves, "verdict": verdict}


def warm_start(work: Path, data: Path) -> Path:
    """The quickstart model after its 400-step supervised warm start: both learning runs start here."""
    init = work / "quickstart-init"
    create_tiny_model(init, **QUICKSTART_MODEL)
    config = work / "warm-start.toml"
    write_toml(
        config,
        base_config(
            init,
            data,
            run={"steps": 0, "output_dir": str(work / "warm-start")},
            policy={"options": {"model_path": str(init), "torch_threads": 2}},
            sft={"steps": 400, "batch_size": 64, "learning_rate": 5e-4},
        ),
    )
    subprocess.run(
        [str(ROLLOUT), "run", str(config), "--overwrite"], check=True, capture_output=True, cwd=REPO
    )
    return work / "warm-start" / "checkpoints" / "step-00000000" / "policy" / "model"


# Controller capacity


def controller_capacity() -> dict[str, Any]:
    """bench/distributed_controller.py's sweep (1..64 simulated workers), its summary."""
    subprocess.run([sys.executable, str(REPO / "bench" / "distributed_controller.py")], check=True, cwd=REPO)
    return json.loads((REPO / "bench" / "results" / "distributed_controller.json").read_text())["summary"]


Figures = tuple[dict[str, Any], dict[str, Any]]


def sync_bench(work: Path, data: Path, quick: bool, steps: int) -> SyncBench:
    """Syncs of the small model (created on first use) over `steps` steps."""
    small = work / "small"
    if not small.exists():
        SIZES["small"].create(small, seed=0)
    return SyncBench(
        work,
        small,
        data,
        binary=cargo_example("weight_sync"),
        layout=sync_layout(work, small),
        repeats=3 if quick else 9,
        steps=steps,
    )


def sync_part(work: Path, data: Path, quick: bool) -> Figures:
    """The weight-sync rounds and the sync in the shipped settings: headline figures, details."""
    print("weight sync: the ~25M model", flush=True)
    bench = sync_bench(work, data, quick, steps=3 if quick else 12)
    measured = bench.rounds(1 if quick else 3)
    shipped = bench.shipped()
    figures = {
        **sync_results(measured),
        "weight_sync_shipped_settings_pull_fraction_of_raw_chain": shipped["pull_fraction_of_raw_chain"],
    }
    return figures, {"sync_rounds": measured, "sync_shipped_settings": shipped}


def profile_part(work: Path, data: Path, quick: bool) -> Figures:
    """Where a sync's CPU goes at each worker count, and the fraction of the raw chain a sync
    doing that much work could reach at best on this machine's cores."""
    print("weight sync under perf: where its CPU goes", flush=True)
    bench = sync_bench(work, data, quick, steps=3 + sync_cpu.SYNCS_LEFT_OUT if quick else 24)
    profiled = [bench.profiled(workers, os.cpu_count() or 1) for workers in WORKER_COUNTS]
    figures = {
        "weight_sync_cpu_bound_fraction_of_raw_chain": {
            str(m["workers"]): m["cpu_bound_fraction_of_raw_chain"] for m in profiled
        }
    }
    return figures, {"sync_cpu": profiled}


def tail_part(work: Path, data: Path, quick: bool) -> Figures:
    print("step-time tail of configs/distributed.toml", flush=True)
    tail = step_time_tail(work, steps=30 if quick else 150)
    return {"step_seconds_p99_over_median": tail["p99_over_median"]}, {"step_time_tail": tail}


def async_part(work: Path, data: Path, quick: bool) -> Figures:
    print("asynchronous vs synchronous", flush=True)
    model = warm_start(work, data)
    throughput = async_throughput(work, model, data, steps=8 if quick else 20, repeats=1 if quick else 2)
    learning = async_learning(work, model, data, steps=20 if quick else 100)
    figures = {
        "async_speedup_vs_sync": throughput["speedup"],
        "async_learning_not_worse": learning["verdict"]["not_worse"],
    }
    return figures, {"throughput": throughput, "learning": learning}


def controller_part(work: Path, data: Path, quick: bool) -> Figures:
    print("controller capacity", flush=True)
    capacity = controller_capacity()
    # The hardest of the sweep: 64 workers, requests back to back; and the worst p99 of any
    # worker count with 50k samples/s offered (bench/results/distributed_controller.json).
    figures = {
        "controller_samples_per_second": capacity["controller_samples_per_second"]["at_64_workers"],
        "controller_p99_ms": capacity["controller_p99_ms"]["max_paced"],
    }
    return figures, {"controller": capacity}


PARTS: dict[str, Callable[[Path, Path, bool], Figures]] = {
    "sync": sync_part,
    "profile": profile_part,
    "tail": tail_part,
    "async": async_part,
    "controller": controller_part,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "bench" / ".work" / "distributed")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (a smoke run)")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated subset of {','.join(PARTS)}; the others keep their figures in the results",
    )
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}")
    if "profile" in parts and not sync_cpu.perf_available():
        parser.error("--parts profile needs Linux perf on PATH (Debian: apt install linux-perf)")
    work: Path = args.work
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    data_dir = work / "data"
    write_addition_splits(data_dir, train=TRAIN_EXAMPLES, test=TEST_EXAMPLES, seed=0)
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    host = {"cpu_model": cpu_model(), "date": datetime.date.today().isoformat()}
    results["machine"] = {"cpus": os.cpu_count(), "cpu_model": host["cpu_model"]}
    for name, measure in PARTS.items():
        if name in parts:
            record_part(results, name, *measure(work, data_dir / "train.jsonl", args.quick), host)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    summary = {k: v for k, v in results.items() if k != "details"}
    print(json.dumps(summary, indent=2))
    return 0


def record_part(
    results: dict[str, Any], part: str, figures: dict[str, Any], details: dict[str, Any], host: dict[str, str]
) -> None:
    """Puts a part's `figures` and `details` into `results`, and which `host` measured them
    when (`parts`). The part's latest figures from every other kind of host stay under
    `other_hosts.<cpu>.<part>` (`carry_other_hosts`, one part at a time), so that a run on
    one kind of host does not drop another's."""
    measured_by = results.setdefault("parts", {})
    others: dict[str, dict[str, Any]] = results.pop("other_hosts", {})
    before = measured_by.get(part)
    previous = None
    if before is not None:
        previous = {
            "host": before,
            "figures": {key: results[key] for key in figures if key in results},
            "other_hosts": {cpu: parts[part] for cpu, parts in others.items() if part in parts},
        }
    carried = carry_other_hosts(
        previous,
        host["cpu_model"],
        lambda previous: previous["host"]["cpu_model"],
        lambda previous: {"date": previous["host"]["date"], **previous["figures"]},
    )
    for parts in others.values():
        parts.pop(part, None)
    for cpu, part_figures in carried.items():
        others.setdefault(cpu, {})[part] = part_figures
    if any(others.values()):
        results["other_hosts"] = {cpu: parts for cpu, parts in others.items() if parts}
    results.update(figures)
    results.setdefault("details", {}).update(details)
    measured_by[part] = host


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
