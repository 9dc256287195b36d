"""Running code nobody vouches for (a completion, a dataset's tests) under an OS sandbox.

:func:`find_sandbox` returns the sandbox to run such code in, or fails closed:

- ``"bubblewrap"`` (the default): ``bwrap`` from a fixed system path (never ``PATH``), with new
  user, mount, PID, network, IPC, UTS and cgroup namespaces, every capability dropped, a
  read-only view of only what the interpreter needs (its binary, its standard library,
  libpython and the system's shared libraries), a read-only root and ``/dev``, and two sized
  tmpfs mounts, ``/tmp`` and the work directory, as the only writable places. No environment,
  no inherited file descriptors but the ones asked for. Before it is used, a probe run inside
  it must show what isolation means, not merely exit 0: a new PID namespace, uid 65534, no
  network interface but loopback, and a canary file this process made (readable by anyone on
  the host) out of sight. When ``bwrap`` is missing, cannot make its namespaces, or its probe
  shows anything else, :class:`IsolationError` says so: the run does not start.
- ``"rlimits-only"``: an explicit opt-out. The code runs as this user, with only the resource
  limits its harness sets on itself: it can read what this process can and use the network.

Each program also gets a memory and process limit from a cgroup where the machine offers one
(:mod:`rollout_sdk.cgroups`); where it does not, the address-space limit and the sized tmpfs
bound its memory, as :meth:`Sandbox.describe` says.

Why bubblewrap: it ships in Debian (and as a PyPI wheel), needs no root or daemon, and makes
every namespace the code needs in one exec; nsjail needs a build, and Landlock plus seccomp
cover files and syscalls but not the PID or network view.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from rollout_sdk.cgroups import Cgroups, ProgramCgroup, find_cgroups

__all__ = ["BWRAP_PATHS", "IsolationError", "Running", "Sandbox", "find_sandbox", "interpreter"]

Isolation = Literal["bubblewrap", "rlimits-only"]
# Where the sandboxed code's work directory appears inside the sandbox.
WORKDIR = "/work"
# The user the code runs as inside the sandbox (`nobody`).
NOBODY = 65534
# Where bubblewrap is looked for, in order: system paths only. A `bwrap` found on `PATH` could
# be anything (a wrapper that runs the command unisolated would pass a probe that trusts exit
# codes); these must also be owned by root and writable by nobody else.
BWRAP_PATHS = ("/usr/bin/bwrap", "/bin/bwrap", "/usr/local/bin/bwrap")


class IsolationError(RuntimeError):
    """No sandbox of the kind asked for can be had here."""


@dataclass(frozen=True, slots=True)
class Sandbox:
    """How to start a program under the chosen isolation."""

    kind: Isolation
    #: ``bwrap``'s path, with bubblewrap.
    program: str | None = None
    version: str = ""
    #: The per-program memory and process limits, where the machine offers them.
    cgroups: Cgroups | None = field(default=None, compare=False)

    def describe(self) -> str:
        """What protects the host, for the log."""
        limits = self.cgroups.describe() if self.cgroups else _NO_CGROUPS
        if self.kind == "bubblewrap":
            return (
                f"bubblewrap {self.version} at {self.program} (user, mount, PID, network, IPC "
                "namespaces; read-only interpreter and standard library; sized tmpfs for /tmp "
                f"and the work directory; no environment, no capabilities); {limits}"
            )
        return f"resource limits only (isolation = 'rlimits-only': no OS sandbox); {limits}"

    def command(
        self, argv: Sequence[str], scratch_bytes: int, files: Sequence[tuple[str, str]] = ()
    ) -> list[str]:
        """The command line that runs ``argv`` under this sandbox.

        Under bubblewrap, ``/tmp`` and the work directory (:data:`WORKDIR`, the program's
        working directory) are each a tmpfs of ``scratch_bytes // 2``, and ``files`` (host path,
        sandbox path) are bound read-only."""
        if self.kind == "rlimits-only":
            return list(argv)
        return _bubblewrap_command(self.program or BWRAP_PATHS[0], argv, scratch_bytes, files)

    def start(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        scratch_bytes: int,
        memory_bytes: int = 0,
        files: Sequence[tuple[str, str]] = (),
        pass_fds: Sequence[int] = (),
        stderr: Any = subprocess.DEVNULL,
    ) -> Running:
        """Starts ``argv`` in its own session, with an environment of ``PATH`` and ``LC_ALL``
        only, stdin and stdout on ``/dev/null`` and no file descriptors but ``stderr`` and
        ``pass_fds``. ``cwd`` is the working directory with ``rlimits-only`` (under bubblewrap
        it is a tmpfs inside). With cgroups and ``memory_bytes`` > 0, the program is in its
        own cgroup before it runs.

        When this process is root, the program (or bubblewrap) starts as ``nobody``: the
        kernel's limit on processes, which root ignores, then holds."""
        root = os.geteuid() == 0
        if root and self.kind == "rlimits-only":
            os.chown(cwd, NOBODY, NOBODY)
        as_nobody: dict[str, Any] = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if root else {}
        command = self.command(argv, scratch_bytes, files)
        limited = self.cgroups is not None and memory_bytes > 0
        if limited:
            # The shell waits until its pid is in the cgroup, then becomes the program, so
            # nothing of the program runs outside it.
            command = ["/bin/sh", "-c", 'read -r go && exec "$@"', "rollout-sandbox", *command]
        proc = subprocess.Popen(
            command,
            cwd=cwd if self.kind == "rlimits-only" else "/",
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
            start_new_session=True,
            pass_fds=tuple(pass_fds),
            stdin=subprocess.PIPE if limited else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            **as_nobody,
        )
        running = Running(proc)
        if limited and self.cgroups is not None and proc.stdin is not None:
            try:
                running.cgroup = self.cgroups.limit(proc.pid, memory_bytes)
                proc.stdin.write(b"go\n")
                proc.stdin.close()
            except (OSError, ValueError):
                running.stop()
                raise
        return running


@dataclass(slots=True)
class Running:
    """A started program, and its cgroup when it has one."""

    proc: subprocess.Popen[bytes]
    cgroup: ProgramCgroup | None = None

    def stop(self) -> None:
        """Kills the program's session (bubblewrap takes the sandbox with it), reaps it and
        removes its cgroup."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.cgroup is not None:
            self.cgroup.remove()


_NO_CGROUPS = "no cgroup memory limit here: memory is bounded by RLIMIT_AS and the sized tmpfs"


def _bubblewrap_command(
    program: str, argv: Sequence[str], scratch_bytes: int, files: Sequence[tuple[str, str]]
) -> list[str]:
    # Options apply in order: the root (bubblewrap's own tmpfs) and /dev are made read-only
    # last, after every mount point in them exists.
    command = [program, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    command += ["--new-session", "--clearenv", "--cap-drop", "ALL"]
    command += ["--uid", str(NOBODY), "--gid", str(NOBODY), "--proc", "/proc", "--dev", "/dev"]
    half = str(max(scratch_bytes // 2, 1 << 20))
    for directory in ("/tmp", WORKDIR):
        command += ["--size", half, "--perms", "0700", "--tmpfs", directory]
    for link, target in _merged_usr_links():
        command += ["--symlink", target, link]
    for path in interpreter_paths(argv[0]):
        command += ["--ro-bind", path, path]
    for hidden in _hidden_inside(argv[0]):
        command += ["--size", "4096", "--perms", "0555", "--tmpfs", hidden]
    for host, inside in files:
        command += ["--ro-bind", host, inside]
    command += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR]
    for name, value in (("HOME", WORKDIR), ("LC_ALL", "C.UTF-8"), ("PATH", "/usr/bin:/bin")):
        command += ["--setenv", name, value]
    return [*command, "--", *argv]


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


@cache
def interpreter_paths(program: str) -> tuple[str, ...]:
    """What ``program`` (a Python interpreter) needs to run the standard library, to bind
    read-only: its binary, its standard library (extension modules included), libpython and
    the system's shared-library directories. :class:`IsolationError` if any of them is ``/``
    or a home directory, which would bind the user's own files."""
    described = _describe_interpreter(program)
    paths = [os.path.realpath(program), *described["stdlib"]]
    library = described["libpython"]
    if library and os.path.exists(library):
        paths.append(os.path.realpath(library))
    paths += _system_libraries(described["multiarch"])
    paths.append("/etc/ld.so.cache")
    unique: list[str] = []
    for path in sorted({os.path.realpath(path) for path in paths if os.path.exists(path)}):
        if not any(path.startswith(kept + os.sep) for kept in unique):
            _refuse_broad(path)
            unique.append(path)
    return tuple(unique)


@cache
def _hidden_inside(program: str) -> tuple[str, ...]:
    """``site-packages`` directories inside a bound standard library (pyenv keeps them there),
    covered by an empty tmpfs: the code gets the standard library only."""
    described = _describe_interpreter(program)
    return tuple(path for path in described["site"] if os.path.isdir(path))


def _describe_interpreter(program: str) -> dict[str, Any]:
    """Where ``program`` keeps its standard library, libpython and site-packages, as it says."""
    try:
        found = subprocess.run(
            [program, "-I", "-S", "-c", _FACTS], capture_output=True, text=True, timeout=60, check=False
        )
        facts = json.loads(found.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as failure:
        raise IsolationError(f"cannot ask {program} where its standard library is: {failure}") from None
    return facts


# Run by the sandbox's interpreter (which may not be this one) to say what it needs.
_FACTS = """
import json, os, sysconfig
paths = sysconfig.get_paths()
real = os.path.realpath
libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
shared = sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and name
stdlib = sorted({real(paths["stdlib"]), real(paths["platstdlib"])})
site = sorted({real(paths["purelib"]), real(paths["platlib"])})
print(json.dumps({
    "stdlib": stdlib,
    "libpython": real(os.path.join(libdir, name)) if shared else "",
    "multiarch": sysconfig.get_config_var("MULTIARCH") or "",
    "site": [p for p in site if any(p.startswith(root + os.sep) for root in stdlib)],
}))
"""


def _system_libraries(multiarch: str) -> list[str]:
    """The dynamic loader and the system's shared libraries (libc, libm, libz, libssl...):
    the multiarch directories where the distribution has them, else ``/usr/lib``."""
    roots = ["/usr/lib64", "/lib64"]
    if multiarch:
        roots += [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"]
    else:
        roots += ["/usr/lib", "/lib"]
    return [path for path in roots if os.path.isdir(path) and not os.path.islink(path)]


def _merged_usr_links() -> list[tuple[str, str]]:
    """The merged-``/usr`` symlinks (``/lib`` -> ``usr/lib``...), recreated inside."""
    names = ("bin", "lib", "lib32", "lib64")
    return [(f"/{name}", os.readlink(f"/{name}")) for name in names if os.path.islink(f"/{name}")]


def _refuse_broad(path: str) -> None:
    """No bind of ``/`` or of a home directory (``$HOME``, ``/root``, ``/home/<user>``)."""
    real = os.path.realpath(path)
    homes = {os.path.realpath(os.path.expanduser("~")), "/root", "/home"}
    if real == "/" or real in homes or os.path.dirname(real) == "/home":
        raise IsolationError(
            f"the sandbox would bind {real} (the root or a home directory) to run the interpreter; "
            "install Python where its standard library has a directory of its own"
        )


def find_sandbox(isolation: Isolation, *, cgroup: str = "auto") -> Sandbox:
    """The sandbox of kind ``isolation``, checked to work here; :class:`IsolationError`
    naming what is missing when it cannot be had. ``cgroup`` says where each program's
    memory and process limit comes from (:func:`rollout_sdk.cgroups.find_cgroups`)."""
    try:
        cgroups = find_cgroups(cgroup)
    except OSError as err:
        raise IsolationError(str(err)) from None
    if isolation == "rlimits-only":
        return Sandbox(kind="rlimits-only", cgroups=cgroups)
    if isolation != "bubblewrap":
        raise IsolationError(f"unknown isolation {isolation!r}: use 'bubblewrap' or 'rlimits-only'")
    found = _bubblewrap()
    return Sandbox(kind="bubblewrap", program=found.program, version=found.version, cgroups=cgroups)


@cache
def _bubblewrap() -> Sandbox:
    program = _system_bwrap()
    reported = subprocess.run([program, "--version"], capture_output=True, text=True, check=False)
    version = reported.stdout.split()[-1] if reported.stdout.split() else "(unknown version)"
    sandbox = Sandbox(kind="bubblewrap", program=program, version=version)
    prove_isolation(sandbox)
    return sandbox


def _system_bwrap() -> str:
    for path in BWRAP_PATHS:
        try:
            info = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            raise IsolationError(
                f"{path} is not a root-owned file that only root can write: it is not trusted to "
                "sandbox anything"
            )
        return path
    raise IsolationError(
        f"bubblewrap (`bwrap`) is not installed in {', '.join(BWRAP_PATHS)}. Install it (Debian and "
        "Ubuntu: `apt install bubblewrap`), or set isolation = 'rlimits-only' to run the code with "
        "resource limits only (it can then read what this process can and reach the network)"
    )


# Run inside the sandbox by `prove_isolation`: reports what it sees on the channel (fd argv[1]).
_PROBE = """
import json, os, socket, sys
canary = sys.argv[2]
try:
    with open(canary) as found:
        seen = found.read()
except OSError:
    seen = None
facts = {"pid": os.getpid(), "uid": os.getuid(), "interfaces": [name for _, name in socket.if_nameindex()],
         "canary": seen, "nonce": sys.argv[3]}
with socket.socket(fileno=int(sys.argv[1])) as channel:
    channel.sendall(json.dumps(facts).encode())
"""


def prove_isolation(sandbox: Sandbox) -> None:
    """Runs a probe in ``sandbox`` and checks what it saw; :class:`IsolationError` unless it
    ran in a new PID namespace, as uid 65534, with loopback as its only network interface and
    without sight of a canary file that every user of this machine can read."""
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="rollout-sandbox-probe-") as root:
        os.chmod(root, 0o755)
        canary = Path(root, "canary")
        canary.write_text(nonce)
        canary.chmod(0o644)
        ours, theirs = socket.socketpair()
        argv = [interpreter(), "-I", "-S", "-c", _PROBE, str(theirs.fileno()), str(canary), nonce]
        try:
            running = sandbox.start(
                argv,
                cwd=Path(root),
                scratch_bytes=2 << 20,
                pass_fds=(theirs.fileno(),),
                stderr=subprocess.PIPE,
            )
        except OSError as failure:
            raise IsolationError(f"bubblewrap could not start a sandbox: {failure}") from failure
        finally:
            theirs.close()
        with ours:
            ours.settimeout(30)
            report = _read_all(ours)
        try:
            _, err = running.proc.communicate(timeout=30)
        finally:
            running.stop()
    _check_probe(report, nonce, running.proc.returncode, err)


def _read_all(channel: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := channel.recv(65536):
            chunks.append(chunk)
    except OSError:
        pass
    return b"".join(chunks)


def _check_probe(report: bytes, nonce: str, returncode: int, err: bytes) -> None:
    try:
        facts = json.loads(report)
    except ValueError:
        text = err.decode("utf-8", "replace").strip()
        reason = text.splitlines()[-1] if text else f"exit {returncode}"
        raise IsolationError(
            f"bubblewrap cannot create its sandbox here: {reason}. It needs unprivileged user "
            "namespaces (kernel.unprivileged_userns_clone = 1, and in a container a runtime "
            "that allows them), or root. Set isolation = 'rlimits-only' to run the code with "
            "resource limits only"
        ) from None
    broken = []
    if facts.get("nonce") != nonce:
        broken.append("the probe's answer is not the probe's")
    if not isinstance(facts.get("pid"), int) or facts["pid"] > 2:
        broken.append(f"no new PID namespace (the probe ran as pid {facts.get('pid')})")
    if facts.get("uid") != NOBODY:
        broken.append(f"the code runs as uid {facts.get('uid')}, not {NOBODY}")
    if facts.get("interfaces") != ["lo"]:
        broken.append(f"network interfaces {facts.get('interfaces')} are visible")
    if facts.get("canary") is not None:
        broken.append("a file of this machine outside the sandbox is readable")
    if broken:
        raise IsolationError("bubblewrap does not isolate the code here: " + "; ".join(broken))
