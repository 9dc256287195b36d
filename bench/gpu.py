"""Rollout on one CUDA GPU, in one command that stays under 8 minutes.

Four stages, each under a time guard (a stage that would not fit what is left of
``--budget-seconds`` is skipped with the reason recorded; one that runs past its share is
stopped, its subprocesses killed, and what it measured so far kept):

- ``weight_sync``: the model's parameters copied device -> host and host -> device through
  pinned host buffers (``pin_memory``, ``non_blocking`` copies, one synchronize) against
  pageable ones, in GB/s.
- ``engine``: the sampling engine (``rollout generate``) against Hugging Face ``generate``,
  same model, prompts and heavy-tailed budgets (the functions of ``bench/engine_bench.py``,
  run on the device), tokens/s; and a greedy check that both produce the same tokens for a
  few prompts.
- ``grpo``: a short end-to-end GRPO run (``rollout run``, policy on the device):
  completions/s and the median seconds of each phase, from ``metrics.jsonl``.
- ``launch``: ``rollout launch`` with one generation worker and one trainer rank sharing
  the GPU (colocated): ``weight_sync_seconds`` from ``metrics.jsonl``.
- ``engines`` (only when named in ``--stages``: vLLM must be installed on the machine):
  ``bench/engines.py`` on the device, Rollout's engine against vLLM (tokens/s, time to first
  token, weight update time, greedy tokens compared).

Each stage records its peak device memory: ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` in this process (``weight_sync``, HF ``generate``) or in the run's
process (a callback in ``grpo``), and the peak of the device's used memory, polled, for
what runs in other processes (``rollout generate``, ``rollout launch``).

``--dry-run`` runs the same code on the CPU with a tiny model and a few steps (about a
minute on 2 cores), so that the script stays tested where there is no GPU. Without it and without
CUDA the script exits with status 2. Writes ``bench/results/gpu.json`` (``--out``); exits 1
when a stage failed (the JSON says which and why). Run it with ``bench/gpu``; see
docs/gpu-bench.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The stages and their tools live in bench/gpu_*.py: gpu_context (sizes, Context), gpu_guard
# (deadline, subprocesses), gpu_memory (peak device memory) and gpu_stages (the four stages).
from bench.gpu_context import DRY, GPU, Context, Preset  # noqa: E402
from bench.gpu_guard import StageError, StageTimeout, deadline  # noqa: E402

# Re-exported: the grpo stage's runs load the callback as `bench.gpu:PeakDeviceMemory`.
from bench.gpu_memory import PeakDeviceMemory as PeakDeviceMemory  # noqa: E402
from bench.gpu_memory import release_device_memory  # noqa: E402
from bench.gpu_stages import (  # noqa: E402
    stage_engine,
    stage_engines,
    stage_grpo,
    stage_launch,
    stage_weight_sync,
)

if TYPE_CHECKING:
    import torch

RESULTS = REPO / "bench" / "results" / "gpu.json"
STAGES = ("weight_sync", "engine", "grpo", "launch")
# Run only when asked for: they need what the default stages do not (vLLM).
OPTIONAL_STAGES = ("engines",)


def run_stage(
    name: str, ctx: Context, body: Callable[[Context, dict[str, Any]], None], stages: dict[str, Any]
) -> None:
    """Run one stage under the guard; its result (partial if it failed) goes into ``stages``."""
    result: dict[str, Any] = {}
    stages[name] = result
    left = ctx.remaining()
    least = ctx.preset.stage_min_seconds[name]
    if left < least:
        result.update(
            status="skipped",
            reason=f"time guard: {left:.0f} s of the {ctx.preset.budget_seconds:.0f} s budget left, "
            f"the stage needs at least {least:.0f} s",
        )
        print(f"[{name}] skipped: {result['reason']}", flush=True)
        return
    share = min(ctx.preset.stage_max_seconds[name], left)
    print(f"[{name}] starting ({share:.0f} s at most, {left:.0f} s of the budget left)", flush=True)
    started = time.perf_counter()
    try:
        with deadline(share):
            body(ctx, result)
        result["status"] = "ok"
    except StageTimeout as error:
        result.update(status="timeout", reason=str(error))
    except (StageError, SystemExit) as error:
        result.update(status="error", reason=str(error))
    except Exception as error:
        result.update(
            status="error", reason=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()
        )
    finally:
        result["seconds"] = time.perf_counter() - started
        release_device_memory(ctx.device)
    print(f"[{name}] {result['status']} in {result['seconds']:.1f} s", flush=True)
    if result["status"] != "ok":
        print(f"[{name}] {result['reason']}", flush=True)


def check_binary(rollout: Path) -> str | None:
    """Why ``rollout`` cannot run here (a missing file, a libpython it was not built for), or None."""
    if not rollout.exists():
        return f"{rollout} does not exist (build it with scripts/setup.sh)"
    try:
        result = subprocess.run([str(rollout), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{rollout} --version failed: {error}"
    if result.returncode != 0:
        return f"{rollout} --version exited with status {result.returncode}: {result.stderr.strip()[-800:]}"
    return None


def host_cpu() -> str:
    """The CPU's model name; unlike ``bench.distributed.cpu_model``, the architecture where
    ``/proc/cpuinfo`` names none (ARM hosts) or cannot be read."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "host_cpu": host_cpu(),
        "host_cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "gpu": None,
        "gpu_memory_bytes": None,
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(
            gpu=properties.name,
            gpu_memory_bytes=properties.total_memory,
            gpu_capability=f"{properties.major}.{properties.minor}",
        )
    return info


def create_model(ctx: Context) -> dict[str, Any]:
    from python_plugins.quickstart import create_tiny_model

    preset = ctx.preset
    if not (ctx.model_dir / "config.json").exists():
        create_tiny_model(
            ctx.model_dir,
            hidden_size=preset.hidden_size,
            num_layers=preset.num_layers,
            num_heads=preset.num_heads,
            intermediate_size=preset.intermediate_size,
            max_positions=preset.max_positions,
            seed=ctx.seed,
        )
    from safetensors import safe_open

    parameters = 0
    for path in ctx.model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            for key in weights.keys():
                parameters += math.prod(weights.get_slice(key).get_shape())
    return {
        "path": str(ctx.model_dir),
        "hidden_size": preset.hidden_size,
        "layers": preset.num_layers,
        "heads": preset.num_heads,
        "intermediate_size": preset.intermediate_size,
        "parameters": parameters,
        "dtype": "float32",
    }


def summary(stages: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The headline figures, flat (None where a stage did not measure them)."""

    def get(stage: str, *keys: str) -> Any:
        value: Any = stages.get(stage, {})
        for key in keys:
            if not isinstance(value, Mapping) or key not in value:
                return None
            value = value[key]
        return value

    return {
        "engine_tokens_per_second": get("engine", "tokens_per_second_rollout"),
        "hf_generate_tokens_per_second": get("engine", "tokens_per_second_hf_generate"),
        "engine_speedup_vs_hf_generate": get("engine", "speedup_vs_hf_generate"),
        "greedy_equal": get("engine", "greedy", "all_equal"),
        "grpo_completions_per_second": get("grpo", "completions_per_second"),
        "grpo_step_seconds": get("grpo", "step_seconds"),
        "grpo_phase_seconds": get("grpo", "phase_seconds"),
        "pinned_device_to_host_gb_per_second": get("weight_sync", "pinned", "device_to_host_gb_per_second"),
        "pinned_host_to_device_gb_per_second": get("weight_sync", "pinned", "host_to_device_gb_per_second"),
        "pageable_device_to_host_gb_per_second": get(
            "weight_sync", "pageable", "device_to_host_gb_per_second"
        ),
        "pageable_host_to_device_gb_per_second": get(
            "weight_sync", "pageable", "host_to_device_gb_per_second"
        ),
        "launch_weight_sync_seconds": get("launch", "weight_sync_seconds_median"),
        "peak_memory": {
            "weight_sync": get("weight_sync", "memory"),
            "hf_generate": _first_run_memory(stages, "hf_generate"),
            "engine": _first_run_memory(stages, "rollout"),
            "grpo": get("grpo", "memory"),
            "launch": get("launch", "memory"),
        },
    }


def _first_run_memory(stages: Mapping[str, Mapping[str, Any]], side: str) -> Any:
    runs = stages.get("engine", {}).get("runs") or []
    return runs[0].get(side, {}).get("memory") if runs else None


BODIES: dict[str, Callable[[Context, dict[str, Any]], None]] = {
    "weight_sync": stage_weight_sync,
    "engine": stage_engine,
    "grpo": stage_grpo,
    "launch": stage_launch,
    "engines": stage_engines,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes and few steps, on the CPU unless --device says"
    )
    parser.add_argument("--device", help="torch device (default: cuda, or cpu with --dry-run)")
    parser.add_argument(
        "--stages",
        nargs="+",
        choices=STAGES + OPTIONAL_STAGES,
        default=list(STAGES),
        help="stages to run, in this order",
    )
    parser.add_argument(
        "--budget-seconds", type=float, help="time guard for the whole run (default: preset's)"
    )
    parser.add_argument(
        "--rollout",
        type=Path,
        default=Path(os.environ.get("ROLLOUT", REPO / "target" / "release" / "rollout")),
        help="the rollout binary (default: $ROLLOUT, else target/release/rollout)",
    )
    parser.add_argument("--work", type=Path, help="models, configs, runs and logs (default: artifacts/)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    args.command = "bench/gpu " + " ".join(sys.argv[1:] if argv is None else argv)
    import torch
    from transformers.utils import logging as transformers_logging

    device = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"bench/gpu: no CUDA device here (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}); this benchmark needs one GPU. `bench/gpu --dry-run` runs the "
            "same stages on the CPU with tiny sizes.",
            file=sys.stderr,
        )
        return 2
    preset = DRY if args.dry_run else GPU
    if args.budget_seconds is not None:
        preset = dataclasses.replace(preset, budget_seconds=args.budget_seconds)
    transformers_logging.disable_progress_bar()
    threads = torch.get_num_threads()
    torch.set_num_threads(preset.threads)
    try:
        return run(args, preset, device, started)
    finally:
        torch.set_num_threads(threads)  # main() also runs in-process, in the tests


def run(args: argparse.Namespace, preset: Preset, device: torch.device, started: float) -> int:
    work = (args.work or REPO / "artifacts" / ("bench-gpu-dry" if args.dry_run else "bench-gpu")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / f"llama-h{preset.hidden_size}-l{preset.num_layers}-i{preset.intermediate_size}"
    ctx = Context(
        preset=preset,
        device=device,
        rollout=args.rollout.resolve(),
        work=work,
        model_dir=model_dir,
        seed=args.seed,
        dry_run=args.dry_run,
        started=started,
    )
    if any(stage != "weight_sync" for stage in args.stages):
        ctx.binary_problem = check_binary(ctx.rollout)
        if ctx.binary_problem:
            print(f"warning: {ctx.binary_problem}; stages that need it will fail", file=sys.stderr)
    stages: dict[str, Any] = {}
    report: dict[str, Any] = {
        "command": args.command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "device": str(device),
        **machine(device),
        "budget_seconds": preset.budget_seconds,
        "binary": str(ctx.rollout),
        "binary_problem": ctx.binary_problem,
        "model": create_model(ctx),
        "stages": stages,
    }
    print(f"model: {report['model']['parameters'] / 1e6:.1f}M parameters on {device}", flush=True)
    try:
        for name in args.stages:
            run_stage(name, ctx, BODIES[name], stages)
    finally:
        report["summary"] = summary(stages)
        report["wall_seconds"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["summary"], indent=2))
        print(f"wrote {args.out} in {report['wall_seconds']:.0f} s", flush=True)
    failed = [name for name, stage in stages.items() if stage["status"] in ("error", "timeout")]
    if failed:
        print(f"bench/gpu: stages failed: {', '.join(failed)} (reasons in {args.out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
