"""Checkpoints that do not stop training: background writes against blocking ones.

The same GRPO run (a 25M-parameter model; its checkpoints measure 101 MB, the weights: in
these runs the optimizer file holds no AdamW moments, only the RNG state) is run three ways,
interleaved over `--rounds`: checkpointing every `--every` steps in the background
(`[checkpoint] background = true`, the default), the same with blocking writes
(`background = false`), and checkpointing only at the end. Reported from each run's
summary.json: how long the checkpoints taken during the run held the step loop up, how long
they took to reach the disk (the last one, written in the foreground in every mode, left
out), and the wall time against the run that barely checkpoints. Writes
bench/results/checkpoints.json. Run `bench/checkpoints` (it sets up the environment).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.e2e.runs import write_toml  # noqa: E402
from python_plugins.quickstart import create_tiny_model, write_addition_splits  # noqa: E402

RESULTS = REPO / "bench" / "results" / "checkpoints.json"
ROLLOUT = REPO / "target" / "release" / "rollout"
MODES = {"background": (True, True), "blocking": (True, False), "end_only": (False, True)}


def write_config(
    work: Path, name: str, model: Path, data: Path, steps: int, every: int, background: bool
) -> Path:
    path = work / f"{name}.toml"
    write_toml(
        path,
        {
            "run": {
                "name": name,
                "seed": 0,
                "steps": steps,
                "output_dir": str(work / name),
                "log_samples": 0,
            },
            "policy": {
                "plugin": "python_plugins.hf_policy:HFCausalLM",
                "options": {"model_path": str(model), "torch_threads": 2},
            },
            "data": {
                "plugin": "python_plugins.data:JsonlPrompts",
                "options": {"path": str(data), "template": "{question}"},
            },
            "[]rewards": {"plugin": "python_plugins.rewards:ExactMatch"},
            "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8},
            "train": {"learning_rate": 1e-4, "micro_batch_tokens": 256},
            "checkpoint": {"every": every, "keep": 2, "background": background},
        },
    )
    return path


def run_once(config: Path, output: Path) -> dict[str, Any]:
    shutil.rmtree(output, ignore_errors=True)
    started = time.monotonic()
    finished = subprocess.run([str(ROLLOUT), "run", str(config)], capture_output=True, text=True, cwd=REPO)
    if finished.returncode != 0:
        raise SystemExit(f"{config.name} failed:\n{finished.stderr[-3000:]}")
    summary = json.loads((output / "summary.json").read_text())
    summary["process_seconds"] = time.monotonic() - started
    checkpoint = output / "checkpoints" / (output / "checkpoints" / "latest").read_text().strip()
    summary["checkpoint_bytes"] = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    return summary


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    def median(key: str) -> float:
        return statistics.median(float(run[key]) for run in runs)

    return {
        "runs": len(runs),
        "checkpoints_per_run": median("checkpoints_written"),
        "wall_seconds": median("wall_seconds"),
        "blocked_seconds": median("checkpoint_blocked_seconds"),
        "write_seconds": median("checkpoint_write_seconds"),
        "checkpoint_bytes": median("checkpoint_bytes"),
    }


def per_periodic_checkpoint(mode: dict[str, float], end_only: dict[str, float]) -> dict[str, float]:
    """Seconds per checkpoint taken during the run: every run's last checkpoint is written in
    the foreground whatever the mode, as the end-only run's one is, so that one is left out."""
    periodic = max(mode["checkpoints_per_run"] - end_only["checkpoints_per_run"], 1)
    return {
        "blocked_seconds_per_checkpoint": (mode["blocked_seconds"] - end_only["blocked_seconds"]) / periodic,
        "write_seconds_per_checkpoint": (mode["write_seconds"] - end_only["write_seconds"]) / periodic,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=REPO / "bench" / ".work" / "checkpoints")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    if not (model / "config.json").exists():
        create_tiny_model(model, hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1376, seed=0)
    data, _ = write_addition_splits(args.work / "data", train=256, test=8, seed=0)

    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for mode, (periodic, background) in MODES.items():
            every = args.every if periodic else 0
            config = write_config(args.work, mode, model, data, args.steps, every, background)
            runs[mode].append(run_once(config, args.work / mode))
            print(f"round {round_index + 1} {mode}: {json.dumps(summarize(runs[mode][-1:]))}", flush=True)

    modes = {mode: summarize(mode_runs) for mode, mode_runs in runs.items()}
    end_only = modes["end_only"]
    for mode in ("background", "blocking"):
        modes[mode].update(per_periodic_checkpoint(modes[mode], end_only))
        modes[mode]["wall_over_end_only"] = modes[mode]["wall_seconds"] / end_only["wall_seconds"]
    result = {
        "when": datetime.now().isoformat(timespec="seconds"),
        "command": "bench/checkpoints " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "every": args.every,
        "modes": modes,
        "blocked_ratio_background_over_blocking": modes["background"]["blocked_seconds_per_checkpoint"]
        / max(modes["blocking"]["blocked_seconds_per_checkpoint"], 1e-9),
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
