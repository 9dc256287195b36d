"""What one sandboxed program takes of the host's memory: a completion that fills every
writable place with files, and a watch on ``MemAvailable`` while something runs. Shared by
tests/python/test_isolation.py and bench/red_team.py (standard library only)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# A completion that writes files just under a 1 MiB per-file limit to every place it can,
# up to 4 GiB, and returns how many bytes it wrote.
FILL = """
def fill():
    written = 0
    for directory in ('/tmp', '.', '/dev/shm', '/'):
        for index in range(4096):
            if written >= 4 << 30:
                return written
            try:
                with open(f'{directory}/fill-{index}', 'wb') as out:
                    out.write(b'x' * ((1 << 20) - 4096))
                written += (1 << 20) - 4096
            except OSError:
                break
    return written
"""


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def memory_fall(action: Callable[[], T]) -> tuple[T, int]:
    """``action()``'s result, and how far the host's available memory fell below where it
    was before, sampled every 5 ms while it ran."""
    before = available_bytes()
    lowest, done = [before], threading.Event()

    def watch() -> None:
        while not done.wait(0.005):
            lowest[0] = min(lowest[0], available_bytes())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = action()
    finally:
        done.set()
        watcher.join()
    return result, before - lowest[0]
