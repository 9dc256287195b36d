"""Controller capacity with simulated generation workers (no model).

Runs the ``controller_capacity`` example of the rollout-core crate: 1 to 64 simulated
generation workers, each a loopback TCP server behind an authenticated link that answers every
``GenerateRequest`` at once, and the product's ``RemoteWorkers`` dealing requests out to them
and reassembling the groups. Simulated work costs nothing, so what is measured is the
controller: JSON, framing, authenticated TCP, dispatch and reassembly.

Two kinds of configuration:

- back to back (``PxGxK``): K requests of P prompts x group size G always in flight, the
  controller saturated; gives the most samples per second, and latency that includes queueing
  behind the other K-1 requests;
- paced (``PxGxK@R``): requests offered at R samples per second (at most K in flight); gives the
  dispatch latency at that load.

Latency is from the ``generate()`` call to the whole response reassembled. The simulated
workers share the machine's cores with the controller; ``controller_cpu_us_per_sample`` is the
CPU time of the controller's own threads per sample, and
``controller_cpu_bound_samples_per_second`` what that would allow on a core of its own.

Run with ``.venv/bin/python bench/distributed_controller.py``; writes
``bench/results/distributed_controller.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "distributed_controller.json"
TARGET_SAMPLES_PER_SECOND = 50_000.0
TARGET_P99_MS = 5.0

Configuration = dict[str, Any]


CARGO_RUN = ["cargo", "run", "--release", "--example", "controller_capacity", "-p", "rollout-core", "--"]
# Longer completions cost the controller more JSON per sample; measured at one worker count.
SWEEP_WORKERS = "8"
SWEEP_SHAPES = "64x8x4"
SWEEP_COMPLETION_TOKENS = "128,512"


def example_command(args: argparse.Namespace, sweep: bool = False) -> list[str]:
    command = list(CARGO_RUN)
    for flag, value in [
        ("--seconds", args.seconds),
        ("--warmup", args.warmup),
        ("--workers", SWEEP_WORKERS if sweep else args.workers),
        ("--shapes", SWEEP_SHAPES if sweep else args.shapes),
        ("--completion-tokens", SWEEP_COMPLETION_TOKENS if sweep else args.completion_tokens),
        ("--controller-threads", args.controller_threads),
        ("--sim-threads", args.sim_threads),
    ]:
        if value is not None:
            command += [flag, str(value)]
    if args.shared_runtime:
        command.append("--shared-runtime")
    return command


def run_example(command: list[str]) -> dict[str, Any]:
    """Builds and runs the example; its progress goes to our stderr, its JSON is returned."""
    env = dict(os.environ)
    # The same interpreter as scripts/setup.sh builds with, so pyo3 is not rebuilt.
    env["PYO3_PYTHON"] = str(REPO / ".venv" / "bin" / "python")
    print(f"$ {shlex.join(command)}", file=sys.stderr, flush=True)
    completed = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, check=False)
    if completed.returncode != 0:
        sys.exit(f"controller_capacity failed with exit status {completed.returncode}")
    try:
        return json.loads(completed.stdout)
    except json.JSONDecodeError as err:
        sys.exit(f"controller_capacity printed no JSON object: {err}")


def number(configuration: Configuration, field: str) -> float:
    """A measured value; NaN where the example had none (it writes JSON null then)."""
    value = configuration.get(field)
    return float(value) if value is not None else float("nan")


def finite(value: Any) -> Any:
    """``value`` with every NaN replaced by None, so the file stays strict JSON."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite(item) for item in value]
    return value


def label(configuration: Configuration) -> Configuration:
    """The fields that name a configuration."""
    keys = ("workers", "prompts_per_request", "group_size", "in_flight", "mode", "offered_samples_per_second")
    return {key: configuration.get(key) for key in keys}


def summarize(configurations: list[Configuration]) -> dict[str, Any]:
    if not configurations:
        sys.exit("controller_capacity measured no configuration")
    best = max(configurations, key=lambda c: number(c, "samples_per_second"))
    at_64 = [c for c in configurations if c.get("workers") == 64]
    best_at_64 = max(at_64, key=lambda c: number(c, "samples_per_second")) if at_64 else None
    worst_p99 = max(configurations, key=lambda c: number(c, "p99_ms"))
    paced = [c for c in configurations if c.get("mode") == "paced"]
    worst_paced = max(paced, key=lambda c: number(c, "p99_ms")) if paced else None
    best_rate = number(best, "samples_per_second")
    rate_at_64 = number(best_at_64, "samples_per_second") if best_at_64 else None
    paced_p99 = number(worst_paced, "p99_ms") if worst_paced else None
    met_at_64 = rate_at_64 is not None and rate_at_64 >= TARGET_SAMPLES_PER_SECOND
    return {
        "controller_samples_per_second": {
            "best": best_rate,
            "best_configuration": label(best),
            "at_64_workers": rate_at_64,
            "at_64_workers_configuration": label(best_at_64) if best_at_64 else None,
            "min_over_back_to_back": min(
                (number(c, "samples_per_second") for c in configurations if c.get("mode") != "paced"),
                default=None,
            ),
        },
        "controller_p99_ms": {
            "at_best": number(best, "p99_ms"),
            "max": number(worst_p99, "p99_ms"),
            "max_configuration": label(worst_p99),
            "max_paced": paced_p99,
            "max_paced_configuration": label(worst_paced) if worst_paced else None,
        },
        "targets": {
            "samples_per_second": TARGET_SAMPLES_PER_SECOND,
            "p99_ms": TARGET_P99_MS,
            "throughput_met": best_rate >= TARGET_SAMPLES_PER_SECOND,
            "throughput_met_at_64_workers": met_at_64,
            "p99_met_at_best": number(best, "p99_ms") < TARGET_P99_MS,
            "p99_met_everywhere": number(worst_p99, "p99_ms") < TARGET_P99_MS,
            "p99_met_paced": paced_p99 is not None and paced_p99 < TARGET_P99_MS,
        },
    }


def git_commit() -> str | None:
    try:
        completed = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return completed.stdout.strip() or None


def print_table(configurations: list[Configuration]) -> None:
    header = (
        f"{'workers':>7} {'shape':>7} {'mode':>20} {'tokens':>6} {'samples/s':>10} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'ctl us/sample':>13}"
    )
    print(header, file=sys.stderr)
    for c in configurations:
        if c.get("mode") == "paced":
            mode = f"paced {c.get('offered_samples_per_second'):.0f}/s"
        else:
            mode = f"{c.get('in_flight')} in flight"
        shape = f"{c.get('prompts_per_request')}x{c.get('group_size')}"
        print(
            f"{c.get('workers'):>7} {shape:>7} {mode:>20} {c.get('completion_tokens'):>6} "
            f"{number(c, 'samples_per_second'):>10.0f} "
            f"{number(c, 'p50_ms'):>8.3f} {number(c, 'p99_ms'):>8.3f} "
            f"{number(c, 'controller_cpu_us_per_sample'):>13.3f}",
            file=sys.stderr,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, help="measured seconds per configuration (at most 10)")
    parser.add_argument("--warmup", type=float, help="warm-up seconds per configuration")
    parser.add_argument("--workers", help="worker counts, e.g. 1,2,4,8,16,32,64")
    parser.add_argument("--shapes", help="PxGxK[@RATE],... e.g. 64x8x4,64x8x4@50000,8x8x2,8x8x2@50000")
    parser.add_argument("--completion-tokens", help="tokens per simulated completion, e.g. 8 (the default)")
    parser.add_argument(
        "--no-sweep", action="store_true", help="skip the completion-length sweep (128 and 512 tokens)"
    )
    parser.add_argument("--controller-threads", type=int, help="tokio worker threads of the controller")
    parser.add_argument("--sim-threads", type=int, help="threads of the simulated workers' runtime")
    parser.add_argument(
        "--shared-runtime", action="store_true", help="run the simulated workers on the controller's runtime"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    command = example_command(args)
    measured = run_example(command)
    configurations: list[Configuration] = measured.get("configurations", [])
    print_table(configurations)
    sweep: dict[str, Any] | None = None
    if not args.no_sweep:
        sweep_command = example_command(args, sweep=True)
        swept = run_example(sweep_command)
        print_table(swept.get("configurations", []))
        sweep = {
            "description": "the same controller path, longer simulated completions (more JSON per sample)",
            "command": shlex.join(sweep_command),
            "settings": swept.get("settings", {}),
            "configurations": swept.get("configurations", []),
        }
    result = {
        "benchmark": "distributed_controller",
        "description": "controller capacity with simulated generation workers (no model), loopback TCP",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": shlex.join(command),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "summary": summarize(configurations),
        "settings": measured.get("settings", {}),
        "configurations": configurations,
        "completion_length_sweep": sweep,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    result = finite(result)
    args.output.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    summary = result["summary"]
    print(json.dumps(summary, indent=2), file=sys.stderr)
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
