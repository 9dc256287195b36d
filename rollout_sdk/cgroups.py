"""A memory and process limit per sandboxed program, from the kernel's cgroups.

The address-space limit a program sets on itself does not count what it keeps outside its
address space (files in a tmpfs, System V shared memory, kernel buffers); a cgroup counts all
of it and kills the program at the limit. :func:`find_cgroups` finds where this process may
make child cgroups, in this order:

- a **cgroup v2** directory named by ``cgroup = "/sys/fs/cgroup/..."`` (delegated to this
  user, with no processes of its own, as ``systemd-run -p Delegate=yes`` or a container
  runtime makes), or this process's own v2 cgroup when the kernel lets it enable the memory
  and pids controllers for children;
- the **cgroup v1** memory and pids hierarchies, where they are mounted and writable (hybrid
  hosts);
- else none: the caller says so (``describe``) and falls back to the address-space limit and
  sized tmpfs mounts.

Each program gets its own child cgroup (``program-<n>``), removed once the program is reaped;
the parent (``rollout-sandbox-<pid>``) is removed at exit, or by the next process to look
for cgroups when this one was killed.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import os
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = ["CgroupError", "Cgroups", "ProgramCgroup", "find_cgroups"]

# The processes a sandboxed program may have at once: bubblewrap, its init, the program.
PIDS = 8


class CgroupError(OSError):
    """A cgroup could not be made or joined."""


@dataclass(frozen=True, slots=True)
class ProgramCgroup:
    """One program's cgroup(s): one directory under v2, one per controller under v1."""

    directories: tuple[Path, ...]
    version: int

    def peak_bytes(self) -> int | None:
        """The most memory the program used, where the kernel reports it."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        return _read_int(self.directories[0] / name)

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the program for memory."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (self.directories[0] / name).read_text()
        except OSError:
            return False
        counts = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)
        return int(counts.get("oom_kill", "0")) > 0

    def remove(self) -> None:
        """Removes the cgroup(s); the program must be dead (retries while the kernel empties
        them, then leaves them for :func:`_remove_at_exit`)."""
        for directory in self.directories:
            _rmdir(directory)


@dataclass(frozen=True, slots=True)
class Cgroups:
    """Where this process makes its programs' cgroups."""

    version: int
    #: The parent of every program's cgroup: one directory (v2) or memory then pids (v1).
    parents: tuple[Path, ...]

    def describe(self) -> str:
        where = ", ".join(str(parent) for parent in self.parents)
        return f"a cgroup v{self.version} memory and process limit per program (under {where})"

    def limit(self, pid: int, memory_bytes: int) -> ProgramCgroup:
        """A new cgroup holding ``pid``, limited to ``memory_bytes`` (no swap) and
        :data:`PIDS` processes. :class:`CgroupError` if it cannot be made."""
        name = f"program-{next(_numbers)}"
        directories = tuple(parent / name for parent in self.parents)
        try:
            for directory in directories:
                directory.mkdir()
            if self.version == 2:
                _write_limits_v2(directories[0], memory_bytes)
            else:
                _write_limits_v1(directories[0], directories[1], memory_bytes)
            for directory in directories:
                (directory / "cgroup.procs").write_text(str(pid))
        except OSError as err:
            ProgramCgroup(directories, self.version).remove()
            raise CgroupError(err.errno, f"cannot limit pid {pid} with a cgroup: {err}") from None
        return ProgramCgroup(directories, self.version)


_numbers = itertools.count()


def _write_limits_v2(directory: Path, memory_bytes: int) -> None:
    (directory / "memory.max").write_text(str(memory_bytes))
    swap = directory / "memory.swap.max"
    if swap.exists():
        swap.write_text("0")
    (directory / "pids.max").write_text(str(PIDS))


def _write_limits_v1(memory: Path, pids: Path, memory_bytes: int) -> None:
    (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
    swap = memory / "memory.memsw.limit_in_bytes"
    if swap.exists():
        swap.write_text(str(memory_bytes))
    (pids / "pids.max").write_text(str(PIDS))


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _rmdir(directory: Path) -> None:
    for attempt in range(20):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as err:
            if err.errno != errno.EBUSY or attempt == 19:
                _leftovers.add(directory)
                return
            time.sleep(0.005 * (attempt + 1))


_leftovers: set[Path] = set()


@cache
def find_cgroups(requested: str = "auto", root: str = "/") -> Cgroups | None:
    """The cgroups to limit programs with, or ``None`` (with the reason on stderr) where the
    machine offers none. ``requested``: ``"auto"``, ``"off"`` or a delegated v2 directory.
    ``root`` is where ``/proc`` and ``/sys`` are read (tests point it elsewhere)."""
    if requested == "off":
        return None
    mounts = _cgroup_mounts(Path(root, "proc/self/mountinfo"), Path(root))
    own = _own_cgroups(Path(root, "proc/self/cgroup"))
    if requested != "auto":
        found = _delegated_v2(Path(requested))
        if found is None:
            raise CgroupError(
                errno.EINVAL,
                f"cgroup = {requested!r}: not a cgroup v2 directory this process can make children "
                "in with the memory and pids controllers",
            )
        return found
    found = _own_v2(mounts, own) or _v1(mounts, own)
    if found is None:
        print(
            "rollout: no cgroup with memory and pids controllers that this process may use; "
            "sandboxed programs are limited by RLIMIT_AS and sized tmpfs mounts only",
            file=sys.stderr,
        )
    return found


def _cgroup_mounts(mountinfo: Path, root: Path) -> dict[str, Path]:
    """Mount points by controller (``"memory"``, ``"pids"``) for v1, and ``"unified"`` for v2."""
    found: dict[str, Path] = {}
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = root / fields[4].replace("\\040", " ").lstrip("/")
        if tail[0] == "cgroup2":
            found.setdefault("unified", point)
        elif tail[0] == "cgroup":
            for option in tail[2].split(","):
                if option in ("memory", "pids"):
                    found.setdefault(option, point)
    return found


def _own_cgroups(proc_cgroup: Path) -> dict[str, str]:
    """This process's cgroup path per v1 controller, and ``"unified"`` for v2."""
    own: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return own
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            own["unified"] = path
        for controller in controllers.split(","):
            own[controller] = path
    return own


def _own_v2(mounts: dict[str, Path], own: dict[str, str]) -> Cgroups | None:
    if "unified" not in mounts or "unified" not in own:
        return None
    return _delegated_v2(mounts["unified"] / own["unified"].lstrip("/"))


def _delegated_v2(directory: Path) -> Cgroups | None:
    """A child of ``directory`` for this process's programs, with memory and pids enabled."""
    try:
        controllers = (directory / "cgroup.controllers").read_text().split()
        if not {"memory", "pids"} <= set(controllers):
            return None
        (directory / "cgroup.subtree_control").write_text("+memory +pids")
        parent = _own_parent(directory)
        (parent / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError:
        return None
    _remove_at_exit(parent)
    return Cgroups(version=2, parents=(parent,))


def _v1(mounts: dict[str, Path], own: dict[str, str]) -> Cgroups | None:
    parents = []
    for controller in ("memory", "pids"):
        if controller not in mounts or controller not in own:
            return None
        try:
            parent = _own_parent(mounts[controller] / own[controller].lstrip("/"))
        except OSError:
            return None
        parents.append(parent)
    for parent in parents:
        _remove_at_exit(parent)
    return Cgroups(version=1, parents=tuple(parents))


def _own_parent(directory: Path) -> Path:
    """This process's parent cgroup under ``directory``, made after removing those of
    processes that are gone (killed before they could remove their own)."""
    for stale in directory.glob("rollout-sandbox-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove_tree(stale)
    parent = directory / f"rollout-sandbox-{os.getpid()}"
    parent.mkdir(exist_ok=True)
    return parent


def _remove_tree(parent: Path) -> None:
    """Removes ``parent`` and its programs' cgroups (a cgroup's files go with it)."""
    for child in parent.glob("program-*"):
        if child.is_dir():
            _rmdir(child)
    _rmdir(parent)


def _remove_at_exit(parent: Path) -> None:
    def remove() -> None:
        for leftover in list(_leftovers):
            _rmdir(leftover)
        _remove_tree(parent)

    atexit.register(remove)
