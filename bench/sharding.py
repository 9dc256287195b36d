"""Per-rank memory of replicated, FSDP2-sharded and sharded + offloaded trainer ranks.

One short supervised run (`[algorithm] name = "sft"`: the one worker only tokenises, so no
rank holds weights it publishes) of a locally created Llama of about 100M
parameters, under `rollout launch` with 1, 2 and 4 trainer ranks in each mode. Every rank
logs the kernel's high-water mark of its resident memory (`VmHWM`) when it shuts down; the
prediction is `rollout plan --launch --json` for the same config. `import_torch_rss_bytes` is
the high-water mark of a Python process that has only imported torch, measured in the same
run: a rank's training-state memory is its peak minus that floor. Each update has one
micro-batch per rank (the others run a padding pass), and the final checkpoint is written, so
the peak is that of the checkpoint's copy of the state.

    .venv/bin/python bench/sharding.py [--ranks 1,2,4] [--modes replicate,fsdp,fsdp_offload]

Writes bench/results/sharding.json; docs/benchmarks.md summarises it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from python_plugins.quickstart import create_tiny_model, write_addition_splits  # noqa: E402

ROLLOUT = REPO / "target" / "release" / "rollout"
RESULTS = REPO / "bench" / "results" / "sharding.json"
MODEL = {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "intermediate_size": 2752}
MODES = {
    "replicate": {"sharding": "replicate"},
    "fsdp": {"sharding": "fsdp"},
    "fsdp_offload": {"sharding": "fsdp", "offload": True},
}
PEAK_LINE = re.compile(r"trainer rank (\d+) of (\d+): peak resident memory (\d+) bytes")
ACCEPTED_ERROR = 0.15
MAX_STATE_RATIO = 0.6


def policy_and_data(model: Path, data: Path) -> str:
    """The [policy] and [data] tables of the sharding benchmarks: `model` on one torch
    thread, prompts from the JSONL file `data`."""
    return f"""[policy]
plugin = "python_plugins.hf_policy:HFCausalLM"
options = {{ model_path = "{model}", torch_threads = 1 }}

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{data}", template = "{{question}}" }}
"""


def config(root: Path, model: Path, data: Path, ranks: int, mode: str) -> Path:
    settings = MODES[mode]
    text = f"""
[run]
name = "sharding-{mode}-{ranks}"
output_dir = "{root / f"run-{mode}-{ranks}"}"
steps = 2
# The addition prompts ("63+11=") are 5-6 characters, their answers at most 4 with EOS.
plan_prompt_tokens = 6

{policy_and_data(model, data)}
[algorithm]
name = "sft"
completion_key = "answer"

[rollout]
prompts_per_step = 8
max_new_tokens = 4

[train]
learning_rate = 1e-4
micro_batch_tokens = 4096
sharding = "{settings["sharding"]}"

[train.fsdp]
offload = {str(settings.get("offload", False)).lower()}

[cluster]
workers = 1
trainers = {ranks}
"""
    path = root / f"{mode}-{ranks}.toml"
    path.write_text(text)
    return path


def predicted_peaks(config_path: Path) -> dict[int, int]:
    command = [str(ROLLOUT), "plan", str(config_path), "--launch", "--json"]
    plan = subprocess.run(command, capture_output=True, text=True, check=False)
    if not plan.stdout.strip():
        raise RuntimeError(f"rollout plan failed: {plan.stderr[-2000:]}")
    roles = json.loads(plan.stdout)["roles"]
    return {
        int(role["role"].split()[1]): max(d["peak_bytes"] for d in role["devices"])
        for role in roles
        if role["role"].startswith("trainer ")
    }


def measured_peaks(config_path: Path) -> tuple[dict[int, int], float]:
    started = time.perf_counter()
    run = subprocess.run(
        [str(ROLLOUT), "launch", str(config_path), "--overwrite"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    seconds = time.perf_counter() - started
    if run.returncode != 0:
        raise RuntimeError(f"{config_path.name} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    peaks = {int(m.group(1)): int(m.group(3)) for m in PEAK_LINE.finditer(run.stdout + run.stderr)}
    return peaks, seconds


def import_torch_floor() -> int:
    code = (
        "import torch\n"
        "for line in open('/proc/self/status'):\n"
        "    if line.startswith('VmHWM'): print(line.split()[1])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip()) * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="sharding-bench-") as scratch:
        root = Path(scratch)
        model = root / "model"
        create_tiny_model(model, seed=0, max_positions=64, **MODEL)
        data, _ = write_addition_splits(root / "data", train=256, test=16, seed=0)
        floor = import_torch_floor()
        results: list[dict[str, Any]] = []
        for count in ranks:
            for mode in modes:
                path = config(root, model, data, count, mode)
                predicted = predicted_peaks(path)
                peaks, seconds = measured_peaks(path)
                if sorted(peaks) != list(range(count)):
                    raise RuntimeError(f"{path.name}: peaks logged for ranks {sorted(peaks)}")
                per_rank = max(peaks.values())
                prediction = max(predicted.values())
                results.append(
                    {
                        "ranks": count,
                        "mode": mode,
                        "parameters": parameter_count(model),
                        "per_rank_peak_bytes": per_rank,
                        "per_rank_peaks_bytes": [peaks[r] for r in range(count)],
                        "predicted_per_rank_peak_bytes": prediction,
                        "prediction_error": prediction / per_rank - 1.0,
                        "training_state_bytes": per_rank - floor,
                        "seconds": round(seconds, 1),
                    }
                )
                print(json.dumps(results[-1]), flush=True)
    summary = summarise(results, floor)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["checks"], indent=2))
    return 0 if all(summary["checks"].values()) else 1


def parameter_count(model: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), framework="pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())


def summarise(results: list[dict[str, Any]], floor: int) -> dict[str, Any]:
    by = {(r["mode"], r["ranks"]): r for r in results}
    checks: dict[str, bool] = {
        "every prediction within 15%": all(abs(r["prediction_error"]) <= ACCEPTED_ERROR for r in results)
    }
    if ("fsdp", 2) in by and ("replicate", 2) in by:
        ratio = by[("fsdp", 2)]["training_state_bytes"] / by[("replicate", 2)]["training_state_bytes"]
        checks[f"fsdp at 2 ranks <= {MAX_STATE_RATIO} x replicate's training state ({ratio:.3f})"] = (
            ratio <= MAX_STATE_RATIO
        )
    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": "bench/sharding.py",
        "model": MODEL,
        "import_torch_rss_bytes": floor,
        "results": results,
        "checks": checks,
    }


if __name__ == "__main__":
    sys.exit(main())
