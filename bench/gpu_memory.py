"""``bench/gpu``'s peak device memory: this process's, the whole device's, and the run's.

``reset_peak_memory`` and ``peak_memory`` read this process's ``torch.cuda`` counters;
:class:`DeviceMemoryPoller` polls the device's used memory for work in other processes; and
:class:`PeakDeviceMemory`, a callback, writes the peak of the ``rollout run`` process it runs in.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_sdk import Callback, RunInfo, StepMetrics

if TYPE_CHECKING:
    import torch


def reset_peak_memory(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """This process's peak device memory since :func:`reset_peak_memory` (None on the CPU)."""
    import torch

    if device.type != "cuda":
        return {"max_memory_allocated_bytes": None, "max_memory_reserved_bytes": None}
    torch.cuda.synchronize(device)
    return {
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(device),
    }


def release_device_memory(device: torch.device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class DeviceMemoryPoller:
    """The peak of the device's used memory (all processes) while the block runs.

    For work in other processes, where ``max_memory_allocated`` cannot be read: the figure
    includes their CUDA contexts and caching allocators; ``baseline`` is what was used
    before (this process's own memory among it). Nothing on the CPU.
    """

    def __init__(self, device: torch.device, interval: float = 0.05) -> None:
        self.device = device
        self.interval = interval
        self.baseline: int | None = None
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _used(self) -> int:
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak or 0, self._used())
            self._stop.wait(self.interval)

    def __enter__(self) -> DeviceMemoryPoller:
        if self.device.type == "cuda":
            self.baseline = self.peak = self._used()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def result(self) -> dict[str, Any]:
        return {
            "device_used_peak_bytes": self.peak,
            "device_used_baseline_bytes": self.baseline,
            "device_used_peak_above_baseline_bytes": (
                None if self.peak is None or self.baseline is None else self.peak - self.baseline
            ),
        }


class PeakDeviceMemory(Callback):
    """Writes the run process's peak device memory to ``path`` after every step (for ``grpo``).

    Loaded by ``rollout run`` as ``bench.gpu:PeakDeviceMemory`` (re-exported there); on the CPU
    it writes the process's peak resident memory instead.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        path: str

    def on_run_start(self, info: RunInfo) -> None:
        self._write()

    def on_step_end(self, step: int, metrics: StepMetrics) -> None:
        self._write()

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        self._write()

    def _write(self) -> None:
        import torch

        record: dict[str, Any] = {
            "max_memory_allocated_bytes": None,
            "max_memory_reserved_bytes": None,
            "host_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            record["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
            record["max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()
        Path(self.config.path).write_text(json.dumps(record) + "\n")
