"""Where a weight sync's CPU goes: a system-wide ``perf`` profile of a real ``rollout launch``,
cut to its syncs.

``perf record -a -k CLOCK_REALTIME`` samples every CPU at a fixed rate (an idle CPU is sampled
as ``swapper``) while the launch writes a ``--trace`` whose timestamps are Unix microseconds.
The samples between the controller's ``weights.publish`` and the end of its ``weights.load``
(the syncs after the first two, which still fault in their buffers) are attributed to the
run's processes by the trace's process names, and to kinds of work by the sampled function.

Dividing a sync's CPU seconds by the machine's cores gives the shortest that sync could take if
nothing ever waited: a bound no scheduling of the same work can beat on this machine.
"""

from __future__ import annotations

import bisect
import json
import re
import shutil
import statistics
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLES_PER_SECOND = 999
# The first syncs of a run fault in the buffers later syncs reuse.
SYNCS_LEFT_OUT = 2
IDLE = "idle"
OTHER_PROCESSES = "other processes"

# Kinds of work, by the sampled function; the first that matches names a sample.
WORK_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernel socket copies", ("_copy_to_iter", "_copy_from_iter", "copy_user", "rep_movs")),
    ("XXH3 hashing", ("xxhash", "xxh3")),
    ("memory copies in user space", ("memmove", "memcpy")),
    (
        "wakeups and interrupts",
        ("spin_unlock_irq", "softirq", "irq_exit", "try_to_wake_up", "finish_task_switch", "ttwu"),
    ),
)

SAMPLE_LINE = re.compile(
    r"^\s*(?P<comm>.+?)\s+(?P<pid>-?\d+)/(?P<tid>-?\d+)\s+(?P<time>\d+\.\d+):\s*(?:[0-9a-f]+\s+(?P<sym>.*))?$"
)
# A line of a sample's call stack (recorded with -g): its address and function, innermost first.
STACK_LINE = re.compile(r"^\s+[0-9a-f]+\s+(?P<sym>.*)$")


@dataclass(frozen=True)
class Sample:
    comm: str
    pid: int
    seconds: float
    function: str


def parse_samples(lines: Iterable[str]) -> list[Sample]:
    """The samples of ``perf script -F comm,pid,tid,time,ip,sym`` output: each sample's
    innermost function, on its own line or, for a profile with call stacks, the first line
    of its stack."""
    samples: list[Sample] = []
    waiting: re.Match[str] | None = None
    for line in lines:
        match = SAMPLE_LINE.match(line)
        if match and match["sym"] is not None:
            samples.append(sample(match, match["sym"]))
            waiting = None
        elif match:
            waiting = match
        elif waiting is not None and (frame := STACK_LINE.match(line)):
            samples.append(sample(waiting, frame["sym"]))
            waiting = None
    return samples


def sample(header: re.Match[str], function: str) -> Sample:
    return Sample(
        comm=header["comm"],
        pid=int(header["pid"]),
        seconds=float(header["time"]),
        function=function.strip() or "[unknown]",
    )


def sync_windows(trace: dict[str, Any]) -> tuple[list[tuple[float, float]], dict[int, str]]:
    """The syncs of a merged ``--trace`` (Unix seconds, from the controller's ``weights.publish``
    to the end of its ``weights.load``, the first ``SYNCS_LEFT_OUT`` left out) and the name of
    each of its processes."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    controller = {pid for pid, name in names.items() if name == "controller"}

    def times(name: str, phase: str) -> list[float]:
        return sorted(
            e["ts"] / 1e6
            for e in events
            if e.get("name") == name and e.get("ph") == phase and e["pid"] in controller
        )

    starts, ends = times("weights.publish", "b"), times("weights.load", "e")
    windows = []
    for start in starts:
        end = next((end for end in ends if end > start), None)
        if end is not None:
            windows.append((start, end))
    return windows[SYNCS_LEFT_OUT:], names


def work_kind(function: str) -> str:
    lowered = function.lower()
    for kind, fragments in WORK_KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def attribute(
    samples: Sequence[Sample],
    windows: Sequence[tuple[float, float]],
    names: dict[int, str],
    samples_per_second: float,
    cores: int,
) -> dict[str, Any]:
    """CPU seconds per sync by process and by kind of work, over the samples inside
    ``windows``; and how busy the cores were meanwhile."""
    starts = [start for start, _ in windows]
    by_process: Counter[str] = Counter()
    by_work: Counter[str] = Counter()
    by_process_and_work: defaultdict[str, Counter[str]] = defaultdict(Counter)
    functions: Counter[tuple[str, str]] = Counter()
    for sample in samples:
        index = bisect.bisect_right(starts, sample.seconds) - 1
        if index < 0 or sample.seconds > windows[index][1]:
            continue
        if sample.comm == "swapper":
            by_process[IDLE] += 1
            continue
        process = names.get(sample.pid, OTHER_PROCESSES)
        kind = work_kind(sample.function)
        by_process[process] += 1
        by_work[kind] += 1
        by_process_and_work[process][kind] += 1
        functions[(process, sample.function)] += 1
    syncs = len(windows)
    per_sync = 1.0 / (samples_per_second * max(syncs, 1))
    busy = sum(count for process, count in by_process.items() if process != IDLE) * per_sync
    seconds = [end - start for start, end in windows]
    wall = statistics.mean(seconds) if seconds else 0.0
    return {
        "syncs": syncs,
        "sync_seconds_median": statistics.median(seconds) if seconds else 0.0,
        "sync_seconds_mean": wall,
        "cpu_seconds_per_sync": busy,
        "busy_cores": busy / wall if wall else 0.0,
        # The shortest the sync could be on `cores` if no thread ever waited for another.
        "cpu_bound_seconds": busy / cores,
        "idle_seconds_per_sync": by_process[IDLE] * per_sync,
        "by_process": scaled(by_process, per_sync, leave_out=IDLE),
        "by_work": scaled(by_work, per_sync),
        "by_process_and_work": {p: scaled(c, per_sync) for p, c in sorted(by_process_and_work.items())},
        "top_functions": [
            [process, function, count * per_sync] for (process, function), count in functions.most_common(15)
        ],
    }


def scaled(counts: Counter[str], factor: float, leave_out: str | None = None) -> dict[str, float]:
    return {key: count * factor for key, count in counts.most_common() if key != leave_out}


def perf_available() -> bool:
    return shutil.which("perf") is not None


def record_command(data: Path) -> list[str]:
    """The prefix that runs a command under a system-wide ``perf record`` writing ``data``,
    its sample times on the clock of the trace's timestamps."""
    return [
        "perf",
        "record",
        "-a",
        "-k",
        "CLOCK_REALTIME",
        "-F",
        str(SAMPLES_PER_SECOND),
        "-o",
        str(data),
        "--",
    ]


def profile(data: Path, trace: Path, cores: int) -> dict[str, Any]:
    """The attribution of the samples in ``data`` to the syncs of ``trace``."""
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "comm,pid,tid,time,ip,sym"],
        capture_output=True,
        text=True,
        check=True,
    )
    windows, names = sync_windows(json.loads(trace.read_text()))
    return attribute(parse_samples(script.stdout.splitlines()), windows, names, SAMPLES_PER_SECOND, cores)
