"""Experiment tracking callbacks: Weights & Biases and TensorBoard.

Both log every step's numeric metrics at that step, the run's resolved config once, and every
``log_samples_every`` steps a table of the step's samples (prompt, completion, reward,
advantage). Callbacks do not receive samples: the trackers read the lines the engine appended
to ``<output_dir>/samples.jsonl`` (written before ``on_step_end``; needs ``run.log_samples > 0``).

Callbacks run in the process that owns the run: ``rollout run``'s, or the controller of
``rollout launch``, so a distributed run makes one tracking run, not one per process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import string
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from rollout_sdk import Callback, RunInfo, StepMetrics

__all__ = [
    "RUN_ID_FILE",
    "SAMPLE_COLUMNS",
    "TensorBoardTracker",
    "WandbTracker",
    "markdown_table",
    "sample_columns",
    "scalar_metrics",
]

SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward", "advantage")
# In the run's output_dir: the W&B run id, so that `--resume` continues the same W&B run.
RUN_ID_FILE = "wandb_run_id"
# Sample tables every this many steps when `log_samples_every` is not set and the run logs samples.
DEFAULT_SAMPLES_EVERY = 10


class _Tracker(Callback):
    """What both trackers share: numeric metrics per step and the sample-table schedule."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.samples: _SampleLog | None = None
        self.samples_every = 0
        self.total_steps = 0

    def on_run_start(self, info: RunInfo) -> None:
        self.total_steps = info.total_steps
        self.samples_every = self._samples_every(info)
        path = Path(info.output_dir) / "samples.jsonl"
        self.samples = _SampleLog(path) if self.samples_every else None

    def on_step_end(self, step: int, metrics: StepMetrics) -> None:
        samples = None
        if self.samples is not None and (step % self.samples_every == 0 or step == self.total_steps):
            # None when the step logged none (e.g. DPO and SFT, which do not sample).
            samples = [s for s in self.samples.read() if s.get("step") == step] or None
        self.log(step, scalar_metrics(metrics), samples)

    def log(self, step: int, scalars: dict[str, float], samples: list[dict[str, Any]] | None) -> None:
        raise NotImplementedError

    def _samples_every(self, info: RunInfo) -> int:
        every = self.config.log_samples_every
        logged = int(info.config.get("run", {}).get("log_samples", 0) or 0)
        if every == 0 or (every is None and logged == 0):
            return 0
        if logged == 0:
            _warn(
                f"{type(self).__name__}: log_samples_every = {every} but run.log_samples = 0, so the run "
                "writes no samples.jsonl and no sample tables are logged; set run.log_samples to log them"
            )
            return 0
        return DEFAULT_SAMPLES_EVERY if every is None else every


class WandbTracker(_Tracker):
    """Weights & Biases: the run's config, every step's metrics, and sample tables.

    ``mode = "offline"`` (the default, unless ``$WANDB_MODE`` says otherwise) writes the run
    under ``<dir>/wandb/offline-run-*`` and never touches the network; upload it later with
    ``wandb sync <dir>/wandb/offline-run-*``.
    The W&B run id is kept in ``<output_dir>/wandb_run_id``: a resumed run (``--resume``,
    ``start_step > 0``) continues the same W&B run.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        project: str = "rollout"
        entity: str | None = None
        # Default: the run's name (`run.name`).
        name: str | None = None
        group: str | None = None
        tags: list[str] = dataclasses.field(default_factory=list)
        notes: str | None = None
        # Unset: $WANDB_MODE when set, else "offline".
        mode: Literal["offline", "online", "disabled"] | None = None
        # Directory that holds `wandb/`. Default: the run's output_dir.
        dir: str | None = None
        # Unset: every 10 steps when the run logs samples (`run.log_samples > 0`); 0: never.
        log_samples_every: int | None = None
        # Continue the same W&B run when the rollout run is resumed.
        resume: bool = True

        def __post_init__(self) -> None:
            _check_every(self.log_samples_every)

    def __init__(self, config: WandbTracker.Config) -> None:
        super().__init__(config)
        try:
            import wandb
        except ImportError as err:
            raise ImportError("WandbTracker needs the `wandb` package: pip install wandb") from err
        self.wandb = wandb
        self.run: Any = None
        self.mode = "offline"

    def on_run_start(self, info: RunInfo) -> None:
        super().on_run_start(info)
        self._finish()
        config = self.config
        self.mode = config.mode or os.environ.get("WANDB_MODE") or "offline"
        directory = Path(config.dir if config.dir is not None else info.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        run_id, resumed = self._run_id(Path(info.output_dir), info.start_step)
        self.run = self.wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.name or info.name,
            group=config.group,
            tags=list(config.tags),
            notes=config.notes,
            config=dict(info.config),
            mode=self.mode,
            dir=str(directory),
            id=run_id,
            resume="allow" if resumed else None,
            reinit="create_new",
        )

    def log(self, step: int, scalars: dict[str, float], samples: list[dict[str, Any]] | None) -> None:
        if self.run is None:
            raise RuntimeError("WandbTracker.on_step_end before on_run_start")
        row: dict[str, Any] = dict(scalars)
        if samples is not None:
            columns = sample_columns(samples)
            rows = [[sample.get(column) for column in columns] for sample in samples]
            row["samples"] = self.wandb.Table(columns=list(columns), data=rows)
        self.run.log(row, step=step)

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        if self.run is not None:
            kept = {k: v for k, v in summary.items() if isinstance(v, (bool, int, float, str))}
            self.run.summary.update({f"run/{k}": v for k, v in kept.items()})
        self._finish()

    def _run_id(self, output_dir: Path, start_step: int) -> tuple[str, bool]:
        """The stored id when resuming a run, else a new one (stored for a later resume)."""
        path = output_dir / RUN_ID_FILE
        if self.config.resume and start_step > 0 and path.is_file():
            stored = path.read_text(encoding="utf-8").strip()
            if stored:
                return stored, True
        alphabet = string.ascii_lowercase + string.digits
        run_id = "".join(secrets.choice(alphabet) for _ in range(8))
        if self.mode != "disabled":
            output_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(run_id + "\n", encoding="utf-8")
        return run_id, False

    def _finish(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()


class TensorBoardTracker(_Tracker):
    """TensorBoard event files: a scalar per metric per step, the config and sample tables as text.

    A resumed run (``start_step > 0``) tells TensorBoard to drop what the interrupted run wrote
    after the checkpoint (``purge_step``), so the redone steps are not shown twice.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        # Default: `<output_dir>/tensorboard`.
        log_dir: str | None = None
        # Unset: every 10 steps when the run logs samples (`run.log_samples > 0`); 0: never.
        log_samples_every: int | None = None

        def __post_init__(self) -> None:
            _check_every(self.log_samples_every)

    def __init__(self, config: TensorBoardTracker.Config) -> None:
        super().__init__(config)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "TensorBoardTracker needs torch and the `tensorboard` package: pip install tensorboard"
            ) from err
        self.writer_class = SummaryWriter
        self.writer: Any = None

    def on_run_start(self, info: RunInfo) -> None:
        super().on_run_start(info)
        self._close()
        log_dir = self.config.log_dir or str(Path(info.output_dir) / "tensorboard")
        purge_step = info.start_step + 1 if info.start_step > 0 else None
        self.writer = self.writer_class(log_dir=log_dir, purge_step=purge_step)
        text = json.dumps(info.config, indent=2, sort_keys=True, default=str)
        self.writer.add_text("config", _code_block(text), global_step=info.start_step)
        self.writer.flush()

    def log(self, step: int, scalars: dict[str, float], samples: list[dict[str, Any]] | None) -> None:
        if self.writer is None:
            raise RuntimeError("TensorBoardTracker.on_step_end before on_run_start")
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        if samples is not None:
            self.writer.add_text("samples", markdown_table(samples), global_step=step)
        self.writer.flush()

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        self._close()

    def _close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()


class _SampleLog:
    """The complete lines appended to ``samples.jsonl`` since the previous read.

    Starts at the file's end: on resume the engine has already cut it back to the checkpoint's
    step, and those steps were logged before.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as file:
            file.seek(self.offset)
            data = file.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        samples = []
        for line in complete.splitlines():
            try:
                sample = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(sample, dict):
                samples.append(sample)
        return samples


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Every numeric metric but ``step`` (the x axis) as a float; others are left out."""
    return {
        name: float(value)
        for name, value in metrics.items()
        if name != "step" and isinstance(value, (int, float))
    }


def sample_columns(samples: list[dict[str, Any]]) -> tuple[str, ...]:
    """The ``SAMPLE_COLUMNS``, with ``agent`` first in a multi-agent run's samples."""
    return ("agent", *SAMPLE_COLUMNS) if any("agent" in s for s in samples) else SAMPLE_COLUMNS


def markdown_table(samples: list[dict[str, Any]]) -> str:
    """The samples as a Markdown table of their ``sample_columns`` (TensorBoard renders it)."""
    columns = sample_columns(samples)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for sample in samples:
        cells = [_cell(sample.get(column)) for column in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def _code_block(text: str) -> str:
    # Markdown: indented lines are shown verbatim.
    return "\n".join("    " + line for line in text.splitlines())


def _check_every(every: int | None) -> None:
    if every is not None and every < 0:
        raise ValueError(f"log_samples_every must be at least 0, got {every}")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
