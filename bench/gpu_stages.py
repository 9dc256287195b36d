"""``bench/gpu``'s four stages: weight-sync copies, the engine against HF ``generate``, a short
GRPO run and ``rollout launch``. Each takes the run's :class:`Context` and fills its ``result``
(partial when the time guard stops it)."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.e2e import REPO
from bench.gpu_context import Context
from bench.gpu_guard import StageError, run_logged
from bench.gpu_memory import DeviceMemoryPoller, peak_memory, release_device_memory, reset_peak_memory

if TYPE_CHECKING:
    import torch

POLICY = "python_plugins.hf_policy:HFCausalLM"


def require_binary(ctx: Context) -> None:
    if ctx.binary_problem is not None:
        raise StageError(f"the rollout binary cannot run: {ctx.binary_problem}")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise StageError(f"{path} was not written")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


# Stage 1: weight sync through pinned host buffers


def copy_rounds(
    parameters: Sequence[torch.Tensor], pinned: bool, repeats: int, device: torch.device
) -> dict[str, Any]:
    """Seconds of copying every parameter device -> host and back, per round.

    Host buffers are allocated once (pinned or pageable); each direction is a loop of
    ``non_blocking`` copies, one per parameter, and one synchronize. Round 0 is a warm-up.
    """
    import torch

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    host = [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pinned) for p in parameters]
    to_host: list[float] = []
    to_device: list[float] = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            synchronize()
            started = time.perf_counter()
            for buffer, parameter in zip(host, parameters, strict=True):
                buffer.copy_(parameter, non_blocking=True)
            synchronize()
            to_host.append(time.perf_counter() - started)
            started = time.perf_counter()
            for buffer, parameter in zip(host, parameters, strict=True):
                parameter.copy_(buffer, non_blocking=True)
            synchronize()
            to_device.append(time.perf_counter() - started)
    nbytes = sum(p.numel() * p.element_size() for p in parameters)
    to_host, to_device = to_host[1:], to_device[1:]
    return {
        "pinned": pinned,
        "device_to_host_seconds": to_host,
        "host_to_device_seconds": to_device,
        "device_to_host_gb_per_second": nbytes / statistics.median(to_host) / 1e9,
        "host_to_device_gb_per_second": nbytes / statistics.median(to_device) / 1e9,
    }


def stage_weight_sync(ctx: Context, result: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    reset_peak_memory(ctx.device)
    model = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=torch.float32).to(ctx.device)
    parameters = [p.detach() for p in model.parameters()]
    # Pinned memory needs a CUDA device: on the CPU (the dry run) both rounds are pageable.
    pinnable = ctx.cuda
    result.update(
        parameters=sum(p.numel() for p in parameters),
        tensors=len(parameters),
        bytes=sum(p.numel() * p.element_size() for p in parameters),
        dtype="float32",
        pinned_available=pinnable,
    )
    result["pageable"] = copy_rounds(parameters, False, ctx.preset.sync_repeats, ctx.device)
    result["pinned"] = copy_rounds(parameters, pinnable, ctx.preset.sync_repeats, ctx.device)
    for direction in ("device_to_host", "host_to_device"):
        key = f"{direction}_gb_per_second"
        result[f"{direction}_pinned_over_pageable"] = result["pinned"][key] / result["pageable"][key]
    result["memory"] = peak_memory(ctx.device)
    del model, parameters


# Stage 2: the sampling engine against HF generate


def engine_arguments(ctx: Context, extra: Sequence[str] = ()) -> argparse.Namespace:
    """The ``args`` bench/engine_bench.py's functions read, for this preset and device."""
    preset = ctx.preset
    overrides = [f'policy.options.device="{ctx.device}"']
    return argparse.Namespace(
        seed=ctx.seed,
        threads=preset.threads,
        min_tokens=preset.min_tokens,
        max_tokens=preset.max_tokens,
        alpha=1.0,
        prompt_words_min=preset.prompt_words_min,
        prompt_words_max=preset.prompt_words_max,
        rollout_set=[item for kv in overrides for item in ("--set", kv)] + list(extra),
    )


@contextlib.contextmanager
def hf_on_device(module: Any, device: torch.device) -> Iterator[None]:
    """Run ``engine_bench.hf_generate`` (written for the CPU) on ``device``.

    Its model is loaded through the module's ``AutoModelForCausalLM`` (on the CPU, as there,
    then moved to ``device``) and its input tensors are made by factory functions (made on
    ``device`` inside ``torch.device(device)``).
    """
    import torch

    original = module.AutoModelForCausalLM

    class OnDevice:
        @staticmethod
        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            # transformers would read the device context as a device_map: load as on the CPU.
            with torch.device("cpu"):
                model = original.from_pretrained(*args, **kwargs)
            return model.to(device)

    module.AutoModelForCausalLM = OnDevice
    try:
        with device:
            yield
    finally:
        module.AutoModelForCausalLM = original


def hf_greedy(ctx: Context, prompts: Sequence[str], tokens: int) -> list[list[int]]:
    """HF ``generate`` without sampling, one prompt at a time, tokenised as the policy does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from python_plugins.hf_policy import _default_bos_prefix

    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
    model = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=torch.float32).to(ctx.device).eval()
    prefix = _default_bos_prefix(tokenizer)
    outputs = []
    for prompt in prompts:
        ids = prefix + tokenizer(prompt, add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor([ids], device=ctx.device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def until_eos(tokens: Sequence[int], eos: int | None) -> list[int]:
    tokens = list(tokens)
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def greedy_check(ctx: Context, records: Sequence[dict[str, Any]], engine_bench: Any) -> dict[str, Any]:
    """The engine at temperature 0 against HF greedy ``generate`` on the first prompts.

    The engine ignores end-of-sequence (engine_bench's config) and HF stops at it: both are
    compared up to the first end-of-sequence token.
    """
    from transformers import AutoTokenizer

    count = min(ctx.preset.greedy_prompts, len(records))
    tokens = min(ctx.preset.greedy_tokens, ctx.preset.max_tokens)
    prompts = [r["prompt"] for r in records[:count]]
    work = ctx.work / "greedy"
    work.mkdir(parents=True, exist_ok=True)
    output = work / "completions.jsonl"
    args = engine_arguments(
        ctx, ["--set", "rollout.temperature=0.0", "--set", "rollout.top_p=1.0", "--output", str(output)]
    )
    # Groups of two (the smallest a config allows): greedy, both samples are the same.
    greedy_records = [{"prompt": p, "budgets": [tokens, tokens]} for p in prompts]
    engine_bench.rollout_generate(str(ctx.rollout), ctx.model_dir, greedy_records, 2, args, work)
    lines = [json.loads(line) for line in output.read_text().splitlines() if line.strip()]
    samples: dict[int, list[list[int]]] = {}
    for line in sorted(lines, key=lambda line: (line["prompt_index"], line["sample"])):
        samples.setdefault(line["prompt_index"], []).append(line["token_ids"])
    engine = {index: group[0] for index, group in samples.items()}
    expected = hf_greedy(ctx, prompts, tokens)
    eos = AutoTokenizer.from_pretrained(ctx.model_dir).eos_token_id
    rows = []
    for index, hf_tokens in enumerate(expected):
        ours = until_eos(engine.get(index, []), eos)
        theirs = until_eos(hf_tokens, eos)
        first = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            None if len(ours) == len(theirs) else min(len(ours), len(theirs)),
        )
        rows.append(
            {
                "prompt": prompts[index],
                "equal": first is None,
                "first_difference": first,
                "group_samples_equal": len({tuple(t) for t in samples.get(index, [])}) == 1,
            }
        )
    return {
        "prompts": count,
        "tokens": tokens,
        "equal": sum(r["equal"] for r in rows),
        "all_equal": all(r["equal"] for r in rows),
        "rows": rows,
    }


def stage_engine(ctx: Context, result: dict[str, Any]) -> None:
    import numpy as np

    from bench import engine_bench

    preset = ctx.preset
    args = engine_arguments(ctx)
    records = engine_bench.make_workload(np.random.default_rng(ctx.seed), preset.prompts, preset.group, args)
    budgets = [b for r in records for b in r["budgets"]]
    result["workload"] = {
        "prompts": preset.prompts,
        "group_size": preset.group,
        "hf_batch_rows": preset.batch_prompts * preset.group,
        "budgets": f"Pareto(alpha=1.0) truncated to [{preset.min_tokens}, {preset.max_tokens}]",
        "budget_mean": float(np.mean(budgets)),
        "tokens": int(sum(budgets)),
        "temperature": 1.0,
    }
    runs: list[dict[str, Any]] = []
    result["runs"] = runs
    work = ctx.work / "engine"
    work.mkdir(parents=True, exist_ok=True)
    for repeat in range(preset.engine_repeats):
        run: dict[str, Any] = {}
        runs.append(run)
        reset_peak_memory(ctx.device)
        with hf_on_device(engine_bench, ctx.device):
            run["hf_generate"] = engine_bench.hf_generate(
                ctx.model_dir, records, preset.group, preset.batch_prompts, ctx.seed + repeat
            )
        run["hf_generate"]["memory"] = peak_memory(ctx.device)
        release_device_memory(ctx.device)
        require_binary(ctx)
        with DeviceMemoryPoller(ctx.device) as poller:
            run["rollout"] = engine_bench.rollout_generate(
                str(ctx.rollout), ctx.model_dir, records, preset.group, args, work
            )
        run["rollout"]["memory"] = poller.result()
        run["speedup"] = run["rollout"]["tokens_per_second"] / run["hf_generate"]["tokens_per_second"]
        print(
            f"[engine] repeat {repeat}: rollout {run['rollout']['tokens_per_second']:.0f} tok/s, "
            f"hf generate {run['hf_generate']['tokens_per_second']:.0f} tok/s, x{run['speedup']:.2f}",
            flush=True,
        )
    complete = [r for r in runs if "speedup" in r]
    result["tokens_per_second_rollout"] = median([r["rollout"]["tokens_per_second"] for r in complete])
    result["tokens_per_second_hf_generate"] = median([r["hf_generate"]["tokens_per_second"] for r in runs])
    result["speedup_vs_hf_generate"] = median([r["speedup"] for r in complete])
    last = complete[-1]["rollout"]
    result["overhead_fraction"] = last.get("engine/overhead_fraction")
    result["kv_utilisation"] = last.get("engine/kv_utilisation_mean")
    result["greedy"] = greedy_check(ctx, records, engine_bench)


# Stage 3: a short GRPO run


def data_file(ctx: Context) -> Path:
    from python_plugins.quickstart import write_addition_splits

    train = ctx.work / "data" / "train.jsonl"
    if not train.exists():
        write_addition_splits(train.parent, train=2000, test=100, seed=ctx.seed)
    return train


def run_config(ctx: Context, name: str, steps: int, **sections: dict[str, Any]) -> dict[str, Any]:
    preset = ctx.preset
    config: dict[str, Any] = {
        "run": {
            "name": name,
            "output_dir": str(ctx.work / "runs" / name),
            "seed": ctx.seed,
            "steps": steps,
            **ctx.run_options(),
        },
        "policy": {"plugin": POLICY, "options": ctx.policy_options()},
        "data": {
            "plugin": "python_plugins.data:JsonlPrompts",
            "options": {"path": str(data_file(ctx)), "template": "{question}"},
        },
        "[]rewards": {"plugin": "python_plugins.rewards:ExactMatch"},
        "rollout": {
            "prompts_per_step": preset.prompts_per_step,
            "group_size": preset.group_size,
            "max_new_tokens": preset.max_new_tokens,
            "temperature": 1.0,
        },
        "algorithm": {"advantage": "group_norm", "kl_coef": 0.04},
        "train": {"learning_rate": 5e-5},
        "checkpoint": {"every": 0, "keep": 1},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    return config


def planned_peak(ctx: Context, config: Path, flag: str) -> dict[str, Any]:
    """``rollout plan``'s predicted peak of the device the policy is on, per role."""
    result = subprocess.run(
        [str(ctx.rollout), "plan", str(config), flag, "--json"], capture_output=True, text=True, cwd=REPO
    )
    if result.returncode != 0:
        return {"error": result.stderr.strip()[-500:]}
    plan = json.loads(result.stdout)
    return {
        role["role"]: device["peak_bytes"]
        for role in plan["roles"]
        for device in role["devices"]
        if device["device"] == ctx.device.type
    }


def throughput(lines: Sequence[Mapping[str, Any]], warmup: int) -> float | None:
    """Completions per second from the end of step ``warmup`` to the end of the last step."""
    if len(lines) <= warmup:
        return None
    start = lines[warmup - 1]["elapsed_seconds"] if warmup > 0 else 0.0
    return sum(line["completions"] for line in lines[warmup:]) / (lines[-1]["elapsed_seconds"] - start)


def stage_grpo(ctx: Context, result: dict[str, Any]) -> None:
    from bench.e2e.runs import PHASES, read_steps, write_toml

    require_binary(ctx)
    memory = ctx.work / "grpo-memory.json"
    memory.unlink(missing_ok=True)
    config = ctx.work / "grpo.toml"
    steps = ctx.preset.grpo_steps
    write_toml(
        config,
        run_config(
            ctx,
            "gpu-grpo",
            steps,
            **{"[]callbacks": {"plugin": "bench.gpu:PeakDeviceMemory", "options": {"path": str(memory)}}},
        ),
    )
    result["config"] = str(config)
    result["planned_peak_bytes"] = planned_peak(ctx, config, "--run")
    with DeviceMemoryPoller(ctx.device) as poller:
        run_logged([str(ctx.rollout), "run", str(config), "--overwrite"], ctx.work / "logs" / "grpo.log")
    metrics = ctx.work / "runs" / "gpu-grpo" / "metrics.jsonl"
    lines = [line for line in read_metrics(metrics) if not line.get("summary")]
    records = read_steps("rollout", metrics)
    # The first step includes warming up (allocations, kernel selection): left out when possible.
    warmup = 1 if len(records) > 1 else 0
    measured = records[warmup:]
    result.update(
        steps=len(records),
        measured_steps=len(measured),
        completions_per_step=ctx.preset.prompts_per_step * ctx.preset.group_size,
        completions_per_second=throughput(lines, warmup),
        generated_tokens_per_second=median([s["generated_tokens"] / s["step_seconds"] for s in measured]),
        step_seconds=median([s["step_seconds"] for s in measured]),
        phase_seconds={name: median([s[f"{name}_seconds"] for s in measured]) for name in PHASES},
        completion_length_mean=median([s["generated_tokens"] / s["completions"] for s in measured]),
        reward_mean=median([s["reward_mean"] for s in records]),
    )
    result["memory"] = {
        **(json.loads(memory.read_text()) if memory.exists() else {}),
        **poller.result(),
    }


# Stage 4: rollout launch, one worker and one trainer on the GPU


def stage_launch(ctx: Context, result: dict[str, Any]) -> None:
    from bench.e2e.runs import write_toml

    require_binary(ctx)
    config = ctx.work / "launch.toml"
    cluster: dict[str, Any] = {
        "cluster": {"workers": 1, "trainers": 1, "max_staleness": 0, "weight_bucket_bytes": 8 << 20},
        # One GPU for both: the worker sleeps (weights to the host, KV cache freed) while the
        # trainer steps, and wakes before the new weights come (a no-op on the CPU).
        "cluster.devices": {"colocate": True},
    }
    write_toml(config, run_config(ctx, "gpu-launch", ctx.preset.launch_steps, **cluster))
    result["config"] = str(config)
    result["planned_peak_bytes"] = planned_peak(ctx, config, "--launch")
    with DeviceMemoryPoller(ctx.device) as poller:
        run_logged([str(ctx.rollout), "launch", str(config), "--overwrite"], ctx.work / "logs" / "launch.log")
    lines = [
        line
        for line in read_metrics(ctx.work / "runs" / "gpu-launch" / "metrics.jsonl")
        if not line.get("summary")
    ]
    # As bench/distributed.py: the first step's sync includes the workers' first load.
    syncs = [line["weight_sync_seconds"] for line in lines[1:]] or [
        line["weight_sync_seconds"] for line in lines
    ]
    result.update(
        steps=len(lines),
        weight_sync_seconds=syncs,
        weight_sync_seconds_median=median(syncs),
        completions_per_second=throughput(lines, 1 if len(lines) > 1 else 0),
        memory=poller.result(),
    )


def stage_engines(ctx: Context, result: dict[str, Any]) -> None:
    """``bench/engines.py`` on the device: Rollout's engine against vLLM, same model and
    workload; its report is this stage's result. Recorded as skipped where vLLM is missing."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        result["skipped"] = "vLLM is not installed here (docs/vllm.md: `vllm==0.32.0` on a GPU machine)"
        return
    require_binary(ctx)
    out = ctx.work / "engines.json"
    models = ["quickstart_4m"] if ctx.dry_run else ["quickstart_4m", "small_25m"]
    command = [sys.executable, str(REPO / "bench" / "engines.py"), "--rollout", str(ctx.rollout)]
    command += ["--device", ctx.device.type, "--repeats", "1", "--output", str(out), "--models", *models]
    if ctx.dry_run:
        command += ["--prompts", "8", "--max-tokens", "8"]
    completed = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if completed.returncode != 0:
        raise StageError(f"bench/engines.py exited {completed.returncode}: {completed.stderr[-3000:]}")
    result.update(json.loads(out.read_text()))
