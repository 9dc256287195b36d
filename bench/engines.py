"""Rollout's sampling engine against vLLM on the same model, prompts and budgets, in one run.

Both engines are driven the way a run drives them: ``rollout generate`` with
``[engine] backend = "rollout"`` or ``"vllm"`` (vLLM in float32 and eager, as in
configs/vllm.toml), the two alternated ``--repeats`` times so that the machine's drift falls
on both. Measured per engine (medians):

- generated tokens per second over the whole workload (``ignore_eos``, so both generate
  exactly the budgets) and completions per second;
- time to first token: the same prompts with a budget of one token (prefill and one sample);
- peak resident memory of the ``rollout generate`` process (``/usr/bin/time``);
- time to take a new weight version on a generation worker: the policy's weights imported
  into the HF model Rollout's engine runs (``HFCausalLM.import_weights``) against the same
  weights loaded into vLLM (``VllmEngine.load_weights``), in this process;
- greedy outputs of the two in float32, token by token, on a model whose weights are
  perturbed (seeded) so that its greedy answers differ from prompt to prompt.

Run with ``bench/engines``; writes ``bench/results/engines.json``, summarised in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from python_plugins.quickstart import create_tiny_model, write_addition_splits  # noqa: E402
from rollout_sdk import GenerationEngine, Policy, load_plugin  # noqa: E402
from rollout_sdk.weights import StreamedWeights  # noqa: E402

RESULTS = REPO / "bench" / "results" / "engines.json"
ENGINES = ("rollout", "vllm")
# The models: the quickstart's (4.2M parameters) and the 25M one of bench/engine.
MODELS = {
    "quickstart_4m": {"hidden_size": 256, "num_layers": 4, "num_heads": 4},
    "small_25m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8},
}
VLLM_OPTIONS = ("dtype", "float32"), ("enforce_eager", True), ("kv_cache_bytes", 1 << 29)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollout", required=True, help="the rollout binary")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", default="cpu", help="cuda for bench/gpu")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="engines-") as scratch:
        work = Path(scratch)
        write_addition_splits(work / "data", train=args.prompts, test=1, seed=0, digits=2)
        results = {name: measure_model(name, work, args) for name in args.models}
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["bench/engines", *sys.argv[1:]]),
        "machine": machine(),
        "workload": {
            "prompts": args.prompts,
            "group_size": args.group,
            "max_new_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            "threads": args.threads,
            "device": args.device,
            "repeats": args.repeats,
        },
        "models": results,
        "wall_seconds": round(time.time() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def measure_model(name: str, work: Path, args: argparse.Namespace) -> dict:
    model_dir = work / name
    create_tiny_model(model_dir, max_positions=256, seed=0, **MODELS[name])
    perturb_saved_model(model_dir, seed=1)
    parameters = parameter_count(model_dir)
    runs: dict[str, list[dict]] = {engine: [] for engine in ENGINES}
    first_token: dict[str, list[float]] = {engine: [] for engine in ENGINES}
    for _ in range(args.repeats):
        for engine in ENGINES:
            runs[engine].append(generate(engine, model_dir, work, args))
            first_token[engine].append(generate(engine, model_dir, work, args, max_tokens=1)["seconds"])
    per_engine = {
        engine: {
            "tokens_per_second": median(r["tokens_per_second"] for r in runs[engine]),
            "completions_per_second": median(r["completions"] / r["seconds"] for r in runs[engine]),
            "time_to_first_token_seconds": median(first_token[engine]),
            "peak_rss_mib": max((r["peak_rss_mib"] or 0.0) for r in runs[engine]) or None,
            "runs": runs[engine],
        }
        for engine in ENGINES
    }
    per_engine["vllm_over_rollout_tokens_per_second"] = round(
        per_engine["vllm"]["tokens_per_second"] / per_engine["rollout"]["tokens_per_second"], 3
    )
    return {
        "parameters": parameters,
        "engines": per_engine,
        "weight_update_seconds": weight_update_seconds(model_dir, args),
        "greedy_float32": greedy_comparison(model_dir, work, args),
    }


def perturb_saved_model(model_dir: Path, seed: int) -> None:
    """Seeded noise on every weight, so that greedy answers depend on the prompt (a freshly
    initialised model answers every prompt alike)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.save_pretrained(model_dir)


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as tensors:
        return sum(math.prod(tensors.get_slice(key).get_shape()) for key in tensors.keys())


def config_text(engine: str, model_dir: Path, work: Path, args: argparse.Namespace, max_tokens: int) -> str:
    vllm = ", ".join(f"{key} = {json.dumps(value)}" for key, value in VLLM_OPTIONS)
    return f"""
[run]
output_dir = "{work / "out"}"
seed = 0

[policy]
plugin = "python_plugins.hf_policy:HFCausalLM"
options = {{ model_path = "{model_dir}", torch_threads = {args.threads}, device = "{args.device}" }}

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{work / "data" / "train.jsonl"}", template = "{{question}}" }}
shuffle = false

[[rewards]]
plugin = "python_plugins.rewards:ExactMatch"

[rollout]
prompts_per_step = {args.prompts}
group_size = {args.group}
max_new_tokens = {max_tokens}
ignore_eos = true
temperature = 1.0

[engine]
backend = "{engine}"
vllm = {{ {vllm} }}
"""


def generate(
    engine: str,
    model_dir: Path,
    work: Path,
    args: argparse.Namespace,
    *,
    max_tokens: int | None = None,
    greedy: bool = False,
) -> dict:
    """One ``rollout generate`` of the workload; its JSON figures, peak RSS and, when
    ``greedy``, every completion."""
    config = work / f"{engine}.toml"
    config.write_text(config_text(engine, model_dir, work, args, max_tokens or args.max_tokens))
    output = work / f"{engine}.jsonl"
    extra = ["--set", "rollout.temperature=0", "--set", "rollout.ignore_eos=false"] if greedy else []
    timed = ["/usr/bin/time", "-f", "peak_rss_kib=%M"] if Path("/usr/bin/time").exists() else []
    command = [*timed, args.rollout, "generate", str(config), *extra, "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"rollout generate ({engine}) failed:\n{result.stderr[-4000:]}")
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    peaks = [line for line in result.stderr.splitlines() if line.startswith("peak_rss_kib=")]
    stats["peak_rss_mib"] = round(int(peaks[-1].split("=")[1]) / 1024, 1) if peaks else None
    if greedy:
        stats["completions_written"] = [json.loads(line) for line in output.read_text().splitlines()]
    return {key: value for key, value in stats.items() if not key.startswith("engine/")}


def greedy_comparison(model_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    """Both engines' greedy completions in float32, token by token."""
    outputs = {
        engine: generate(engine, model_dir, work, args, greedy=True)["completions_written"]
        for engine in ENGINES
    }
    pairs = list(zip(outputs["rollout"], outputs["vllm"], strict=True))
    identical = sum(a["token_ids"] == b["token_ids"] for a, b in pairs)
    common = [(a, b) for a, b in pairs if a["token_ids"] == b["token_ids"]]
    logprob_gap = max(
        (float(np.abs(np.subtract(a["logprobs"], b["logprobs"])).max()) for a, b in common), default=0.0
    )
    return {
        "completions": len(pairs),
        "identical_token_ids": identical,
        "distinct_completions": len({tuple(a["token_ids"]) for a, _ in pairs}),
        "max_logprob_difference_when_identical": logprob_gap,
    }


def weight_update_seconds(model_dir: Path, args: argparse.Namespace, repeats: int = 5) -> dict:
    """Median seconds for a generation worker to take a new version: into the HF model
    Rollout's engine runs, and into vLLM."""
    policy = load_plugin(
        "python_plugins.hf_policy:HFCausalLM",
        {"model_path": str(model_dir), "torch_threads": args.threads, "device": args.device},
        Policy,
    )
    weights = {name: array.copy() for name, array in policy.export_weights().items()}
    engine = load_plugin(
        "python_plugins.vllm_engine:VllmEngine",
        {"model": str(model_dir), **dict(VLLM_OPTIONS)},
        GenerationEngine,
    )
    timings: dict[str, list[float]] = {"rollout": [], "vllm": []}
    for _ in range(repeats):
        began = time.perf_counter()
        policy.import_weights(StreamedWeights(iter(weights.items())))
        timings["rollout"].append(time.perf_counter() - began)
        began = time.perf_counter()
        engine.load_weights(StreamedWeights(iter(weights.items())))
        timings["vllm"].append(time.perf_counter() - began)
    megabytes = sum(array.nbytes for array in weights.values()) / 2**20
    del engine
    return {
        "version_mib": round(megabytes, 1),
        **{k: round(statistics.median(v), 4) for k, v in timings.items()},
    }


def median(values: object) -> float:
    return round(statistics.median(list(values)), 3)  # type: ignore[call-overload]


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    import vllm

    return {
        "cpu": cpu,
        "cores": len(__import__("os").sched_getaffinity(0)),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "python": platform.python_version(),
    }


if __name__ == "__main__":
    main()
