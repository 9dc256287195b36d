"""What the end-to-end tests share: the `rollout` binary and ways to run it, the configs they
write (a base config plus each test's overrides) and readers of what a run writes.

Configs are Python dicts shaped like the TOML file. `write_config` starts from `e2e_config`
(the tiny local HF model of the `artifacts` fixture on its addition prompts, ExactMatch and
Format rewards, a two-update SFT warm start) and `write_toy_config` from `toy_config` (the
torch-free toy plugins of tests/fixtures); both apply overrides with `apply`:

    write_config(tmp_path, artifacts, {"rollout.group_size": 8, "sandbox": {"processes": 2}})

Overrides are applied in order. A dotted key sets one value, a dict merges into the table that
is there, `None` removes a key and anything else (a list of `[[rewards]]` too) replaces what
was there.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
ROLLOUT = Path(os.environ.get("ROLLOUT_BIN", REPO / "target" / "release" / "rollout"))

TIMEOUT = 300
LAUNCH_TIMEOUT = 300
# Wall times, and the KV cache's size and occupancy (which depend on what the process served
# before, e.g. a resumed run starts with a fresh cache), are not part of the learning signal.
NOT_LEARNING = ("seconds", "per_second", "overhead_fraction", "engine/kv_blocks", "engine/kv_occupancy")
# The generation pool's own bookkeeping, only in runs with separate worker processes.
POOL_METRICS = (
    "workers",
    "workers_joined",
    "workers_lost",
    "leases",
    "leases_revoked",
    "answers_rejected",
    "answers_malformed",
    "samples_excluded_malformed",
    "groups_dropped",
)

Overrides = Mapping[str, Any]


# ---------------------------------------------------------------------------------------------
# Configs: a base and overrides, written as TOML


def e2e_config(directory: Path, model: Path, data: Path) -> dict[str, Any]:
    """The base config: GRPO on `model` with `data`'s addition prompts, output in directory/out."""
    return {
        "run": {"name": "e2e", "output_dir": directory / "out", "seed": 7, "steps": 3},
        "policy": {
            "plugin": "python_plugins.hf_policy:HFCausalLM",
            "options": {"model_path": model, "torch_threads": 1},
        },
        "data": {
            "plugin": "python_plugins.data:JsonlPrompts",
            "options": {"path": data, "template": "{question}"},
        },
        "rewards": [
            {"plugin": "python_plugins.rewards:ExactMatch"},
            {"plugin": "python_plugins.rewards:Format", "weight": 0.5, "options": {"pattern": r"\d+"}},
        ],
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "train": {"learning_rate": 0.001, "micro_batch_tokens": 32},
        "sft": {"steps": 2, "batch_size": 8, "learning_rate": 0.003},
        "checkpoint": {"every": 2},
    }


def toy_config(directory: Path) -> dict[str, Any]:
    """The torch-free base: the toy policy's seeded digit strings on tests/fixtures/prompts.jsonl."""
    return {
        "run": {"output_dir": directory / "out", "seed": 3, "steps": 4, "log_samples": 1000},
        "python": {"paths": [FIXTURES]},
        "policy": {"plugin": "toy_plugins:ToyPolicy"},
        "data": {
            "plugin": "python_plugins.data:JsonlPrompts",
            "options": {"path": FIXTURES / "prompts.jsonl"},
        },
        "rewards": [{"plugin": "toy_plugins:DigitSum"}],
        "rollout": {"prompts_per_step": 3, "group_size": 4, "max_new_tokens": 4},
        "train": {"learning_rate": 0.001},
    }


def write_config(
    directory: Path,
    artifacts: Path,
    *overrides: Overrides | None,
    steps: int | None = None,
    filename: str = "e2e.toml",
) -> Path:
    """Writes directory/filename: `e2e_config` on the `artifacts` fixture's model and train
    split, with `steps` (run.steps) and then each of `overrides` applied."""
    config = e2e_config(directory, artifacts / "model", artifacts / "data" / "train.jsonl")
    if steps is not None:
        config["run"]["steps"] = steps
    return write_toml(directory / filename, apply(config, *overrides))


def write_toy_config(directory: Path, *overrides: Overrides | None, filename: str) -> Path:
    """Writes directory/filename: `toy_config` with each of `overrides` applied."""
    return write_toml(directory / filename, apply(toy_config(directory), *overrides))


def apply(config: dict[str, Any], *overrides: Overrides | None) -> dict[str, Any]:
    """Applies each of `overrides` to `config` in place, in order (see the module's docstring),
    and returns it."""
    for layer in overrides:
        _apply(config, layer or {})
    return config


def _apply(config: dict[str, Any], overrides: Overrides) -> None:
    for key, value in overrides.items():
        *parents, last = key.split(".")
        table = config
        for part in parents:
            if not isinstance(table.get(part), dict):
                table[part] = {}
            table = table[part]
        if value is None:
            table.pop(last, None)
        elif isinstance(value, Mapping):
            if not isinstance(table.get(last), dict):
                table[last] = {}
            _apply(table[last], value)
        else:
            table[last] = copy.deepcopy(value)


def cluster(workers: int, trainers: int, staleness: int | None = None, **options: Any) -> dict[str, Any]:
    """A `[cluster]` section as overrides; `rollout run` reads only its `max_staleness`."""
    section: dict[str, Any] = {"workers": workers, "trainers": trainers}
    if staleness is not None:
        section["max_staleness"] = staleness
    return {"cluster": {**section, **options}}


def gate(directory: Path) -> Path:
    """While this file exists the run waits at its next step boundary (see gate_config)."""
    return directory / "hold"


def gate_config(directory: Path, *callbacks: dict[str, Any]) -> dict[str, Any]:
    """Overrides holding the run at each step's end while `gate(directory)` exists, then
    `callbacks`."""
    hold = {"plugin": "gate_plugins:HoldWhileFileExists", "options": {"path": gate(directory)}}
    return {"python.paths": [FIXTURES], "callbacks": [hold, *callbacks]}


# TOML: the values the configs use (strings and paths, numbers, booleans, arrays, tables).
# A dict under one of these keys is an inline table, as the configs' `options = { ... }` are.
INLINE_TABLES = {"options"}
# Tests check the line numbers of errors in written files (the base config's policy options
# are on line 10): keep this layout, one header line and a blank line between tables.
HEADER = "# Written by tests/e2e/harness.py: a base config plus the test's overrides."
BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def write_toml(path: Path, config: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(config))
    return path


def to_toml(config: Mapping[str, Any]) -> str:
    """`config` as a TOML document: a header comment, then each table (the first on line 2)."""
    lines = [HEADER]
    _table(lines, (), config, None)
    return "\n".join(lines) + "\n"


def _is_table(key: str, value: Any) -> bool:
    return isinstance(value, Mapping) and key not in INLINE_TABLES


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _table(lines: list[str], path: tuple[str, ...], table: Mapping[str, Any], header: str | None) -> None:
    plain = [(k, v) for k, v in table.items() if not _is_table(k, v) and not _is_table_array(v)]
    nested = [(k, v) for k, v in table.items() if _is_table(k, v) or _is_table_array(v)]
    # A table with only sub-tables needs no header of its own; an empty one does.
    if header is not None and (plain or not nested or header.startswith("[[")):
        if len(lines) > 1:
            lines.append("")
        lines.append(header)
    lines.extend(f"{_key(k)} = {_value(v)}" for k, v in plain)
    for key, value in nested:
        inner = (*path, key)
        dotted = ".".join(_key(part) for part in inner)
        if _is_table(key, value):
            _table(lines, inner, value, f"[{dotted}]")
        else:
            for item in value:
                _table(lines, inner, item, f"[[{dotted}]]")


def _key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    escaped = (ESCAPES.get(c, f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text)
    return '"' + "".join(escaped) + '"'


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str | Path):
        return _string(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r} ({type(value).__name__})")


# ---------------------------------------------------------------------------------------------
# Running the binary


def rollout(
    command: str,
    *args: str | Path,
    cwd: Path | None = None,
    check: bool = True,
    timeout: float = TIMEOUT,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`rollout COMMAND ARGS...`; with `check`, a non-zero exit fails the test."""
    if not ROLLOUT.exists():
        pytest.fail(f"{ROLLOUT} is missing: run scripts/setup.sh (or set ROLLOUT_BIN)")
    result = subprocess.run(
        [str(ROLLOUT), command, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env=env,
    )
    if check and result.returncode != 0:
        pytest.fail(f"rollout {command} exited {result.returncode}\n{result.stderr[-6000:]}")
    return result


def run(
    config: Path,
    *args: str,
    check: bool = True,
    timeout: float = TIMEOUT,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`rollout run CONFIG ARGS...` in the config's directory."""
    return rollout("run", config, *args, cwd=config.parent, check=check, timeout=timeout, env=env)


def train(config: Path, *args: str) -> list[dict]:
    """`rollout run` that must succeed; metrics.jsonl's lines (output_dir is the config's out/)."""
    run(config, *args)
    return metrics(config.parent)


def launch(
    config: Path, *args: str, check: bool = True, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`rollout launch CONFIG ARGS...` (controller, workers and trainers) in the config's directory."""
    return rollout("launch", config, *args, cwd=config.parent, check=check, timeout=LAUNCH_TIMEOUT, env=env)


def start(
    command: str, config: Path, *args: str, env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[str], Path]:
    """Starts `rollout COMMAND CONFIG ARGS...` in the background, its stderr in COMMAND.log."""
    log = config.parent / f"{command}.log"
    process = subprocess.Popen(
        [str(ROLLOUT), command, str(config), *args],
        cwd=config.parent,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env=env,
    )
    return process, log


def wait_for(
    predicate: Callable[[], bool], process: subprocess.Popen[str], log: Path, what: str, seconds: float = 120
) -> None:
    """Polls `predicate` while the started process runs; fails if it ends first or takes too long."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert process.poll() is None, f"the run ended before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} after {seconds} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)


def finish(process: subprocess.Popen[str], log: Path, steps: int) -> str:
    """Waits for a started run to end successfully after `steps` steps; returns its stderr."""
    try:
        stdout, _ = process.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = log.read_text()
    assert process.returncode == 0, stderr[-4000:]
    assert f"done: {steps} steps" in stdout
    assert "panicked" not in stderr
    return stderr


def pids(log: Path, role: str) -> list[int]:
    """The pids `rollout launch` logged starting `role` with, in order."""
    return [int(pid) for pid in re.findall(rf"started {role} \(pid (\d+)\)", log.read_text())]


def audit(output: Path, *args: str) -> dict:
    """`rollout audit OUTPUT ARGS...` of a run's output directory: its ledger of prompt groups
    (with "--groups", each update's groups too)."""
    result = rollout("audit", output, *args, check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Reading what a run wrote


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def metrics(directory: Path) -> list[dict]:
    """directory/out/metrics.jsonl"""
    return read_jsonl(directory / "out" / "metrics.jsonl")


def samples(directory: Path) -> list[dict]:
    """directory/out/samples.jsonl"""
    return read_jsonl(directory / "out" / "samples.jsonl")


def learning_signal(lines: list[dict]) -> list[dict]:
    """Metrics lines without wall times and KV cache sizes: what a rerun must reproduce."""
    return [{k: v for k, v in line.items() if not any(word in k for word in NOT_LEARNING)} for line in lines]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def assert_valid_checkpoint(directory: Path, *, max_step: int, min_step: int = 1) -> None:
    """A committed checkpoint: every file its manifest lists, at its size, and a step in range."""
    manifest = json.loads((directory / "manifest.json").read_text())
    listed = {entry["path"]: entry["bytes"] for entry in manifest["files"]}
    assert "state.json" in listed
    for path, size in listed.items():
        assert (directory / path).stat().st_size == size, path
    state = json.loads((directory / "state.json").read_text())
    assert state["step"] == manifest["step"] == int(directory.name.removeprefix("step-"))
    assert min_step <= state["step"] <= max_step
