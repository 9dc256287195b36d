"""Running code nobody vouches for (a completion, a dataset's tests) under an OS sandbox.

:func:`find_sandbox` returns the sandbox to run such code in, or fails closed:

- ``"bubblewrap"`` (the default): ``bwrap`` from the system, with new user, mount, PID,
  network, IPC, UTS and cgroup namespaces, every capability dropped, a read-only view of only
  what the interpreter needs, an empty writable work directory, no inherited environment and
  no inherited file descriptors but the standard ones. It works without root where the kernel
  allows unprivileged user namespaces. When ``bwrap`` is missing or cannot create its
  namespaces (e.g. a container without them), :class:`IsolationError` says so: the run does
  not start.
- ``"rlimits-only"``: an explicit opt-out. The code runs as this user, with only the resource
  limits its harness sets on itself: it can read what this process can and use the network.

Why bubblewrap: it ships in Debian (and as a PyPI wheel), needs no root or daemon, and makes
every namespace the code needs in one exec; nsjail needs a build, and Landlock plus seccomp
cover files and syscalls but not the PID or network view.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

__all__ = ["IsolationError", "Sandbox", "find_sandbox"]

Isolation = Literal["bubblewrap", "rlimits-only"]
# Where the sandboxed code's work directory appears inside the sandbox.
WORKDIR = "/work"
# The user the code runs as inside the sandbox (`nobody`).
NOBODY = 65534


class IsolationError(RuntimeError):
    """No sandbox of the kind asked for can be had here."""


@dataclass(frozen=True, slots=True)
class Sandbox:
    """How to start a program under the chosen isolation."""

    kind: Isolation
    #: ``bwrap``'s path, with bubblewrap.
    program: str | None = None
    version: str = ""

    def describe(self) -> str:
        """What protects the host, for the log."""
        if self.kind == "bubblewrap":
            return (
                f"bubblewrap {self.version} (user, mount, PID, network, IPC namespaces; read-only "
                "interpreter, empty work directory, no environment, no capabilities)"
            )
        return "resource limits only (isolation = 'rlimits-only': no OS sandbox)"

    def popen(self, argv: Sequence[str], workdir: Path, **streams: Any) -> subprocess.Popen[bytes]:
        """Starts ``argv`` with ``workdir`` (empty) as its writable working directory, in its
        own session, with an environment of ``PATH`` and ``LC_ALL`` only; ``streams`` are
        ``Popen``'s ``stdin``/``stdout``/``stderr``.

        Under bubblewrap the program sees ``workdir`` at :data:`WORKDIR` and runs as ``nobody``.
        When this process is root, the program (or bubblewrap) starts as ``nobody``: the
        kernel's limit on processes, which root ignores, then holds."""
        root = os.geteuid() == 0
        if root:
            os.chown(workdir, NOBODY, NOBODY)
        as_nobody: dict[str, Any] = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if root else {}
        command = list(argv) if self.kind == "rlimits-only" else self._command(argv, workdir)
        return subprocess.Popen(
            command,
            cwd=workdir if self.kind == "rlimits-only" else "/",
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
            start_new_session=True,
            **as_nobody,
            **streams,
        )

    def _command(self, argv: Sequence[str], workdir: Path) -> list[str]:
        command = [
            self.program or "bwrap",
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--cap-drop",
            "ALL",
            "--uid",
            str(NOBODY),
            "--gid",
            str(NOBODY),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
        ]
        for path in [*_system(), *_installations(argv[0])]:
            command += ["--ro-bind", path, path]
        for link, target in _links():
            command += ["--symlink", target, link]
        command += [
            "--bind",
            str(workdir),
            WORKDIR,
            "--chdir",
            WORKDIR,
            "--setenv",
            "HOME",
            WORKDIR,
            "--setenv",
            "LC_ALL",
            "C.UTF-8",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--",
            *argv,
        ]
        return command


def interpreter() -> str:
    """The Python to run sandboxed code with (standard library only): this one's real
    executable, or, when this process is root and ``nobody`` cannot reach it (pyenv under
    ``/root``), the system's ``python3``."""
    own = os.path.realpath(sys.executable)
    if os.geteuid() != 0 or _reachable_by_anyone(own):
        return own
    system = shutil.which("python3", path="/usr/bin:/bin")
    return os.path.realpath(system) if system else own


def _reachable_by_anyone(path: str) -> bool:
    """Whether every directory above ``path`` lets others through."""
    parent = os.path.dirname(path)
    while parent and parent != "/":
        if not os.stat(parent).st_mode & 0o001:
            return False
        parent = os.path.dirname(parent)
    return True


def find_sandbox(isolation: Isolation) -> Sandbox:
    """The sandbox of kind ``isolation``, checked to work here; :class:`IsolationError`
    naming what is missing when it cannot be had."""
    if isolation == "rlimits-only":
        return Sandbox(kind="rlimits-only")
    if isolation != "bubblewrap":
        raise IsolationError(f"unknown isolation {isolation!r}: use 'bubblewrap' or 'rlimits-only'")
    return _bubblewrap()


@cache
def _bubblewrap() -> Sandbox:
    program = shutil.which("bwrap")
    if program is None:
        raise IsolationError(
            "bubblewrap (`bwrap`) is not installed. Install it (Debian and Ubuntu: "
            "`apt install bubblewrap`), or set isolation = 'rlimits-only' to run the code with "
            "resource limits only (it can then read what this process can and reach the network)"
        )
    reported = subprocess.run([program, "--version"], capture_output=True, text=True, check=False)
    version = reported.stdout.split()[-1] if reported.stdout.split() else "(unknown version)"
    sandbox = Sandbox(kind="bubblewrap", program=program, version=version)
    with tempfile.TemporaryDirectory(prefix="rollout-sandbox-probe-") as root:
        workdir = Path(root, "work")
        workdir.mkdir()
        os.chmod(root, 0o711)
        try:
            proc = sandbox.popen(
                [interpreter(), "-I", "-S", "-c", "print('isolated')"],
                workdir,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = proc.communicate(timeout=30)
        except (OSError, subprocess.SubprocessError) as failure:
            raise IsolationError(f"bubblewrap could not start a sandbox: {failure}") from failure
    if proc.returncode != 0 or out.decode().strip() != "isolated":
        text = (err or out).decode("utf-8", "replace").strip()
        reason = text.splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise IsolationError(
            f"bubblewrap cannot create its sandbox here: {reason[0]}. It needs unprivileged user "
            "namespaces (kernel.unprivileged_userns_clone = 1, and in a container a runtime "
            "that allows them), or root. Set isolation = 'rlimits-only' to run the code with "
            "resource limits only"
        )
    return sandbox


def _system() -> list[str]:
    """The system's libraries, read-only."""
    paths = ["/usr", "/etc/alternatives", "/etc/ld.so.cache"]
    paths += [f"/{name}" for name in _TOP_LIBRARY_DIRS if not os.path.islink(f"/{name}")]
    return [path for path in paths if os.path.exists(path)]


def _installations(program: str) -> list[str]:
    """The installation ``program`` belongs to, when it lives outside ``/usr`` (pyenv...)."""
    home = os.path.dirname(os.path.dirname(os.path.realpath(program)))
    if home == "/usr" or home.startswith("/usr/") or not os.path.isdir(home):
        return []
    return [home]


_TOP_LIBRARY_DIRS = ("bin", "lib", "lib32", "lib64", "sbin")


def _links() -> list[tuple[str, str]]:
    """The merged-``/usr`` symlinks (``/lib`` -> ``usr/lib``...); real directories there
    are bound read-only instead (:func:`_system`)."""
    return [(f"/{name}", os.readlink(f"/{name}")) for name in _TOP_LIBRARY_DIRS if os.path.islink(f"/{name}")]
