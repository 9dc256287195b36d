"""``bench/gpu``'s time guard: a deadline for a stage, and subprocesses stopped with it.

A stage runs under :func:`deadline`; a command it starts through :func:`run_logged` is stopped,
with everything it started, when the deadline passes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

from bench.e2e import REPO


class StageTimeout(Exception):
    """A stage ran past its share of the time budget."""


class StageError(Exception):
    """A stage could not be measured (a subprocess failed, a result is missing)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`StageTimeout` in the main thread after ``seconds`` (SIGALRM).

    ``subprocess.run`` kills its child when interrupted; :func:`run_logged` stops its child
    and everything the child started.
    """

    def expire(signum: int, frame: FrameType | None) -> None:
        raise StageTimeout(f"stopped after its {seconds:.0f} s share of the time budget")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (``rollout launch`` starts its roles in their own
    process groups, so killing the launcher's group would leave them running)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name (field 2) is in parentheses and may hold spaces.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def stop_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to ``process`` and everything below it, then SIGKILL to what is left after 5 s."""
    tree = descendants(process.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        tree |= descendants(process.pid)
        for pid in (process.pid, *tree):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM and not any(Path(f"/proc/{pid}").exists() for pid in tree):
            return


def run_logged(command: Sequence[str], log: Path) -> None:
    """Run ``command`` in the repository with its output in ``log``; stop it and its
    descendants when interrupted (the time guard), and raise :class:`StageError` when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as output:
        process = subprocess.Popen(list(command), stdout=output, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            status = process.wait()
        except BaseException:
            stop_tree(process)
            raise
    if status != 0:
        raise StageError(f"{' '.join(command[:2])} exited with status {status}; {log}:\n{tail(log)}")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
