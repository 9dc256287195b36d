"""Callbacks: a one-line-per-step console view and a JSONL metrics log."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from rollout_sdk import Callback, RunInfo, StepMetrics

__all__ = ["ConsoleProgress", "JsonlMetrics", "format_duration"]


class ConsoleProgress(Callback):
    """Print ``step  12/100  reward 0.412  loss -0.0031  1.9 samples/s  48 tok/s  eta 1m32s``.

    In a distributed run the line also shows the generation workers, with the joins and
    losses since the previous line: ``workers 3 (+1 -1)``.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        # Print every n-th step (and always the last one).
        every: int = 1

        def __post_init__(self) -> None:
            if self.every < 1:
                raise ValueError(f"every must be at least 1, got {self.every}")

    def __init__(self, config: ConsoleProgress.Config) -> None:
        super().__init__(config)
        self.total_steps: int | None = None
        self.step_seconds: list[float] = []
        self.joined = 0
        self.lost = 0

    def on_run_start(self, info: RunInfo) -> None:
        self.total_steps = info.total_steps
        self.step_seconds = []

    def on_step_end(self, step: int, metrics: StepMetrics) -> None:
        if "step_seconds" in metrics:
            self.step_seconds.append(float(metrics["step_seconds"]))
        self.joined += int(metrics.get("workers_joined", 0))
        self.lost += int(metrics.get("workers_lost", 0))
        if step % self.config.every == 0 or step == self.total_steps:
            print(self.format_line(step, metrics), flush=True)
            self.joined = self.lost = 0

    def format_line(self, step: int, metrics: StepMetrics) -> str:
        total = self.total_steps
        parts = [f"step {step:>{len(str(total))}}/{total}" if total else f"step {step}"]
        if "reward_mean" in metrics:
            parts.append(f"reward {float(metrics['reward_mean']):.3f}")
        if "loss" in metrics:
            parts.append(f"loss {float(metrics['loss']):.4f}")
        seconds = float(metrics.get("step_seconds", 0.0))
        if "samples_per_second" in metrics:
            parts.append(f"{float(metrics['samples_per_second']):.1f} samples/s")
        if "generated_tokens" in metrics and seconds > 0:
            parts.append(f"{float(metrics['generated_tokens']) / seconds:.0f} tok/s")
        if "workers" in metrics:
            changes = f" (+{self.joined} -{self.lost})" if self.joined or self.lost else ""
            parts.append(f"workers {int(metrics['workers'])}{changes}")
        if total and self.step_seconds:
            mean_seconds = sum(self.step_seconds) / len(self.step_seconds)
            parts.append(f"eta {format_duration(mean_seconds * max(total - step, 0))}")
        return "  ".join(parts)


def format_duration(seconds: float) -> str:
    """``45s``, ``1m32s``, ``2h05m``."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class JsonlMetrics(Callback):
    """Append every step's metrics (all, or only ``fields`` plus ``step``) as a JSON line to ``path``.

    At the start of a run the file keeps only the lines of steps up to ``info.start_step``, so a
    resumed run continues the log without duplicate steps (and a fresh run starts it empty).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        path: str
        # Empty: every metric.
        fields: list[str] = dataclasses.field(default_factory=list)

    def __init__(self, config: JsonlMetrics.Config) -> None:
        super().__init__(config)
        self.path = Path(config.path)
        self.file: IO[str] | None = None

    def on_run_start(self, info: RunInfo) -> None:
        self._close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = _lines_up_to_step(self.path, info.start_step) if self.path.exists() else []
        self.path.write_text("".join(kept))
        self.file = self.path.open("a", encoding="utf-8")

    def on_step_end(self, step: int, metrics: StepMetrics) -> None:
        if self.file is None:
            raise RuntimeError("JsonlMetrics.on_step_end before on_run_start")
        fields = self.config.fields
        row = {"step": step} | {k: v for k, v in metrics.items() if not fields or k in fields}
        self.file.write(json.dumps(row, default=_plain_value) + "\n")
        self.file.flush()

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        self._close()

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _lines_up_to_step(path: Path, last_step: int) -> list[str]:
    """The complete JSON lines of ``path`` whose ``step`` is at most ``last_step``."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            continue
        if line.endswith("\n") and isinstance(step, int) and step <= last_step:
            kept.append(line)
    return kept


def _plain_value(value: Any) -> Any:
    """NumPy and torch scalars become Python numbers; anything else its string."""
    return value.item() if hasattr(value, "item") else str(value)
