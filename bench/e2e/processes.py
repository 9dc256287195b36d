"""Running a command while measuring the peak resident memory of its process tree."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.e2e import REPO


def run_measured(command: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``command`` to completion; its wall time and the peak resident memory of its process tree.

    The peak is the larger of the polled sum over the tree and the largest per-process
    high-water mark (``VmHWM``, kept by the kernel since ``exec``). ``ru_maxrss`` from ``wait4``
    would not do: Linux carries the parent's peak into a child it forks.
    """
    import psutil

    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        peak = 0
        stop = threading.Event()

        def poll() -> None:
            nonlocal peak
            root = psutil.Process(process.pid)
            while not stop.is_set():
                try:
                    tree = [root, *root.children(recursive=True)]
                except psutil.Error:
                    break
                current = [_rss_and_high_water(p.pid) for p in tree]
                peak = max(peak, sum(rss for rss, _ in current), *(hwm for _, hwm in current))
                stop.wait(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        process.wait()
        stop.set()
        poller.join()
    wall = time.perf_counter() - started
    if process.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"{' '.join(map(str, command))} failed ({process.returncode}); {log}:\n{tail}")
    return {"wall_seconds": wall, "peak_rss_bytes": peak}


def _rss_and_high_water(pid: int) -> tuple[int, int]:
    """``VmRSS`` and ``VmHWM`` of a process in bytes; zeros once it is gone."""
    values = {"VmRSS:": 0, "VmHWM:": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            fields = line.split()
            if fields and fields[0] in values:
                values[fields[0]] = int(fields[1]) * 1024
    except (OSError, ValueError):
        pass
    return values["VmRSS:"], values["VmHWM:"]
