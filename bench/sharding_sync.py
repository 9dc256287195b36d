"""Weight sync from FSDP2-sharded trainer ranks against replicated ones, same run.

A short GRPO run of the ~100M-parameter Llama of bench/sharding.py under `rollout launch`,
2 trainer ranks and 1 generation worker, once replicated and once sharded, alternating
(replicate, fsdp, replicate, fsdp: these machines are noisy). Each step's
`weight_sync_seconds` in `metrics.jsonl` is the whole sync: export on the trainer (sharded:
every tensor gathered to rank 0 one at a time), transfer, checksum and import on the worker.
The first step is left out (it includes the engine's first allocations).

    .venv/bin/python bench/sharding_sync.py [--rounds 2] [--steps 5]

Writes bench/results/sharding_sync.json; docs/benchmarks.md summarises it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.sharding import MODEL, ROLLOUT, parameter_count, policy_and_data  # noqa: E402
from python_plugins.quickstart import create_tiny_model, write_addition_splits  # noqa: E402

RESULTS = REPO / "bench" / "results" / "sharding_sync.json"
MODES = ("replicate", "fsdp")


def config(root: Path, model: Path, data: Path, mode: str, steps: int, round_: int) -> Path:
    output = root / f"run-{mode}-{round_}"
    text = f"""
[run]
name = "sync-{mode}"
output_dir = "{output}"
steps = {steps}

{policy_and_data(model, data)}
[[rewards]]
plugin = "python_plugins.rewards:ExactMatch"

[rollout]
prompts_per_step = 2
group_size = 2
max_new_tokens = 2

[train]
learning_rate = 1e-5
sharding = "{mode}"

[checkpoint]
every = 1000

[cluster]
workers = 1
trainers = 2
"""
    path = root / f"sync-{mode}-{round_}.toml"
    path.write_text(text)
    return path


def sync_seconds(path: Path) -> list[float]:
    run = subprocess.run(
        [str(ROLLOUT), "launch", str(path), "--overwrite"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(f"{path.name} failed:\n{run.stderr[-4000:]}")
    output = path.parent / path.stem.replace("sync-", "run-")
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return [line["weight_sync_seconds"] for line in lines if "weight_sync_seconds" in line][1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sharding-sync-") as scratch:
        root = Path(scratch)
        model = root / "model"
        create_tiny_model(model, seed=0, max_positions=64, **MODEL)
        data, _ = write_addition_splits(root / "data", train=64, test=8, seed=0)
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            for mode in MODES:
                measured = sync_seconds(config(root, model, data, mode, args.steps, round_))
                print(f"round {round_} {mode}: {measured}", flush=True)
                seconds[mode].extend(measured)
        parameters = parameter_count(model)
    medians = {mode: statistics.median(values) for mode, values in seconds.items()}
    summary: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": "bench/sharding_sync.py",
        "model": MODEL,
        "parameters": parameters,
        "weight_bytes": parameters * 4,
        "trainers": 2,
        "workers": 1,
        "weight_sync_seconds": seconds,
        "median_weight_sync_seconds": medians,
        "fsdp_over_replicate": medians["fsdp"] / medians["replicate"],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("median_weight_sync_seconds", "fsdp_over_replicate")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
