"""Callbacks: observe a run (progress views, trackers, alerts). They cannot change it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollout_sdk.metrics import StepMetrics
from rollout_sdk.plugin import Plugin

__all__ = ["Callback", "RunInfo"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo:
    name: str
    output_dir: str
    total_steps: int
    start_step: int
    config: Mapping[str, Any]


class Callback(Plugin):
    def on_run_start(self, info: RunInfo) -> None:
        """Called once before the first step (``info.start_step > 0`` when resuming)."""

    def on_step_end(self, step: int, metrics: StepMetrics) -> None:
        """Called after every step with the line written to ``metrics.jsonl``."""

    def on_checkpoint(self, step: int, path: str) -> None:
        """Called after a checkpoint was completely written."""

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        """Called once at the end of a run, also when it was interrupted."""
