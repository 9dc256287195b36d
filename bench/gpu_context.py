"""What a ``bench/gpu`` stage is given: the sizes of the run (:data:`GPU` or :data:`DRY`) and
its :class:`Context` (device, binary, working directory, time left)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Preset:
    """Sizes of one kind of run: the full one on a GPU, or the dry run on the CPU."""

    # The model (python_plugins.quickstart.create_tiny_model).
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    threads: int
    # weight_sync: timed rounds after one untimed warm-up round.
    sync_repeats: int
    # engine: the workload of bench/engine_bench.py.
    prompts: int
    group: int
    batch_prompts: int
    min_tokens: int
    max_tokens: int
    prompt_words_min: int
    prompt_words_max: int
    engine_repeats: int
    greedy_prompts: int
    greedy_tokens: int
    # grpo and launch.
    grpo_steps: int
    launch_steps: int
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    # The time guard: the whole run's seconds, and each stage's share and least useful time.
    budget_seconds: float
    stage_max_seconds: Mapping[str, float]
    stage_min_seconds: Mapping[str, float]


GPU = Preset(
    # About 110M parameters: Llama, hidden 768, 12 layers (GPT-2 small's shape).
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    intermediate_size=3072,
    max_positions=256,
    threads=4,
    sync_repeats=5,
    prompts=64,
    group=8,
    batch_prompts=16,
    min_tokens=8,
    max_tokens=128,
    prompt_words_min=8,
    prompt_words_max=24,
    engine_repeats=2,
    greedy_prompts=4,
    greedy_tokens=32,
    grpo_steps=10,
    launch_steps=4,
    prompts_per_step=16,
    group_size=8,
    max_new_tokens=32,
    # 7 minutes: the rest of the 8 is for starting Python, creating the model, writing.
    budget_seconds=420,
    stage_max_seconds={"weight_sync": 45, "engine": 150, "grpo": 120, "launch": 120, "engines": 300},
    stage_min_seconds={"weight_sync": 10, "engine": 40, "grpo": 40, "launch": 40, "engines": 120},
)

DRY = Preset(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    intermediate_size=128,
    max_positions=256,
    threads=1,
    sync_repeats=2,
    prompts=4,
    group=2,
    batch_prompts=2,
    min_tokens=4,
    max_tokens=16,
    prompt_words_min=2,
    prompt_words_max=4,
    engine_repeats=1,
    greedy_prompts=2,
    greedy_tokens=8,
    grpo_steps=2,
    launch_steps=2,
    prompts_per_step=2,
    group_size=2,
    max_new_tokens=8,
    budget_seconds=170,
    stage_max_seconds={"weight_sync": 30, "engine": 70, "grpo": 60, "launch": 90, "engines": 300},
    stage_min_seconds={"weight_sync": 2, "engine": 10, "grpo": 10, "launch": 10, "engines": 60},
)


@dataclasses.dataclass
class Context:
    preset: Preset
    device: torch.device
    rollout: Path
    work: Path
    model_dir: Path
    seed: int
    dry_run: bool
    started: float
    # Why the binary cannot run here (None: it can); the parts that need it fail at once with it.
    binary_problem: str | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def remaining(self) -> float:
        return self.preset.budget_seconds - (time.perf_counter() - self.started)

    def policy_options(self) -> dict[str, Any]:
        return {
            "model_path": str(self.model_dir),
            "torch_threads": self.preset.threads,
            "device": str(self.device),
            "dtype": "float32",
        }

    def run_options(self) -> dict[str, Any]:
        """``[run]`` keys for every config: on CUDA, the device's memory for the plan check."""
        if not self.cuda:
            return {}
        import torch

        total = torch.cuda.get_device_properties(self.device).total_memory
        return {"memory_limit_gb": int(total // 10**9)}
