"""The program ``python_plugins.code_reward`` runs (as ``python -I -S -c <this file>``) to test
one completion's code. Standard library only: it runs in a bare interpreter.

It reads ``{"code", "tests", "workdir", "nonce", "limits", "preload"}`` as JSON from stdin,
imports the ``preload`` modules, then, before any of the completion's code runs:

1. applies resource limits to itself: address space, CPU seconds, file size, open files, no
   core dumps, and no new processes or threads (``RLIMIT_NPROC`` 0);
2. as root, hands the work directory to ``nobody`` and becomes ``nobody`` (so root-only files
   are unreadable and the process limit holds);
3. sends its own stdout to ``/dev/null``, keeping a private copy for the result;
4. installs an audit hook that refuses sockets, subprocesses, ``fork``, ``ctypes``, and any
   file access outside the work directory (reads of the interpreter's own library excepted).

It then runs the code and each test (``exec`` in one namespace) and writes
``RESULT <nonce> {"passed": n, "total": m}``. The audit hook is a guard against code that
misbehaves by accident or naively, not a security boundary: the OS limits (and the network
namespace the reward adds) are what bound the process.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

NOBODY = 65534
BLOCKED_EVENTS = (
    "socket.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.spawn",
    "os.kill",
    "os.killpg",
    "ctypes.",
    "shutil.rmtree",
)
PATH_EVENTS = ("open", "os.listdir", "os.scandir", "os.chdir", "os.remove", "os.rename", "os.rmdir")


def set_limits(limits: dict[str, int]) -> None:
    memory = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    size = limits["max_file_bytes"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))


def become_nobody(workdir: str) -> None:
    if os.geteuid() != 0:
        return
    os.chown(workdir, NOBODY, NOBODY)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def private_stdout() -> Any:
    """A private copy of stdout for the result; fd 1 now goes to /dev/null."""
    sys.stdout.flush()
    result = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    return result


def make_guard(workdir: str) -> Any:
    readable = tuple(
        {
            os.path.realpath(p) + os.sep
            for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
        }
    )
    inside = os.path.realpath(workdir) + os.sep

    def allowed(path: Any, writing: bool) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor
        real = os.path.realpath(os.fsdecode(path)) + os.sep
        return real.startswith(inside) or (not writing and real.startswith(readable))

    def guard(event: str, args: tuple[Any, ...]) -> None:
        if event.startswith(BLOCKED_EVENTS):
            raise PermissionError(f"{event} is not allowed here")
        if event in PATH_EVENTS and args and args[0] is not None:
            if not allowed(args[0], writes(event, args)):
                raise PermissionError(f"{event} outside the work directory: {args[0]!r}")

    return guard


def writes(event: str, args: tuple[Any, ...]) -> bool:
    """Whether a path event may change the file system (listing and reading do not)."""
    if event in ("os.listdir", "os.scandir"):
        return False
    if event != "open":
        return True
    mode = args[1] if len(args) > 1 else None
    if mode is not None:
        return any(ch in str(mode) for ch in "wax+")
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))


def run(code: str, tests: list[str]) -> int:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except BaseException:
        return 0
    passed = 0
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{index}.py", "exec"), dict(namespace))
        except BaseException:
            continue
        passed += 1
    return passed


def preload(modules: list[str]) -> None:
    """Import modules solutions may use while the interpreter's library is still readable
    (``nobody`` may not read it, e.g. under ``/root``); a missing one is skipped."""
    for name in modules:
        try:
            __import__(name)
        except ImportError:
            continue


def main() -> None:
    payload = json.loads(sys.stdin.read())
    workdir = payload["workdir"]
    os.chdir(workdir)
    preload(payload["preload"])
    set_limits(payload["limits"])
    become_nobody(workdir)
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    out = private_stdout()
    nonce = payload["nonce"]
    tests = list(payload["tests"])
    sys.addaudithook(make_guard(workdir))
    passed = run(payload["code"], tests)
    out.write(f"RESULT {nonce} " + json.dumps({"passed": passed, "total": len(tests)}) + "\n")
    out.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
