"""Reading back what the tracking callbacks wrote, with wandb's and TensorBoard's own readers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def wandb_run_dirs(directory: Path) -> list[Path]:
    return sorted((directory / "wandb").glob("offline-run-*"))


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of the run's `.wandb` transaction log, as wandb itself parses it."""
    (log,) = run_dir.glob("run-*.wandb")
    result = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def wandb_history(records: list[dict]) -> dict[int, dict]:
    return {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}


def wandb_config(records: list[dict]) -> dict:
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return run["config"]["update"]


def wandb_table(run_dir: Path, item: dict) -> dict:
    return json.loads((run_dir / "files" / item["samples.path"]).read_text())


def tensorboard(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in events.Scalars(tag)}


def texts(events: EventAccumulator, tag: str) -> dict[int, str]:
    if f"{tag}/text_summary" not in events.Tags()["tensors"]:
        return {}
    return {
        event.step: event.tensor_proto.string_val[0].decode()
        for event in events.Tensors(f"{tag}/text_summary")
    }


# ---------------------------------------------------------------------------------------------
# A run, as the engine drives callbacks
