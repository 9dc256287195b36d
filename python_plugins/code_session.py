"""One run of a completion's code under the sandbox, driven over the harness's channel.

The reward holds one end of a socket pair; the harness (``code_harness.py``) the other, as its
only descriptor besides ``/dev/null``. Requests go one at a time; each answer must be a frame
within the size cap carrying the request's id. The sandbox's stdout and stderr are never read.

Two kinds of failure are told apart:

- :class:`ProgramEnded`: the program is gone (it exited, crashed, or was killed at a limit or
  the deadline). The call fails, as would any later one: its tests fail, as an honest
  program's would.
- :class:`ChannelBroken`: something other than the harness's answers came down the channel
  (an oversized or torn frame, the wrong id, a message of the wrong shape), which only the
  completion's own code can cause. The reward fails that sample alone.

:class:`HarnessDidNotStart`: no ``ready`` arrived, before any of the completion's code ran.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from python_plugins.code_wire import FrameError, read_frame, write_frame
from rollout_sdk.isolation import Running, Sandbox, interpreter

__all__ = ["ChannelBroken", "HarnessDidNotStart", "Limits", "Program", "ProgramEnded"]

HERE = Path(__file__).resolve().parent
HARNESS_FILES = ("code_wire.py", "code_harness.py")
# Where the harness's files are bound inside the sandbox.
HARNESS_DIR = "/harness"
BOOT = "import sys; sys.path.insert(0, {directory!r}); import code_harness; code_harness.main()"


class ProgramEnded(RuntimeError):
    """The program is no longer running: this call and every later one fail."""


class ChannelBroken(RuntimeError):
    """The channel carried something the harness never sends: the sample fails."""


class HarnessDidNotStart(RuntimeError):
    """The harness never said it was ready (before any of the completion's code ran)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What one sample's program may use."""

    timeout_seconds: float
    cpu_seconds: int
    memory_mb: int
    max_file_bytes: int
    scratch_mb: int
    max_value_bytes: int
    max_value_items: int
    max_requests: int
    #: The seccomp filter the harness installs on itself (``rollout_sdk.seccomp``), if any.
    seccomp: bytes | None

    def for_harness(self) -> dict[str, int]:
        return {
            "memory_mb": self.memory_mb,
            "cpu_seconds": self.cpu_seconds,
            "max_file_bytes": self.max_file_bytes,
            "max_value_bytes": self.max_value_bytes,
            "max_value_items": self.max_value_items,
        }


class Program:
    """The completion's code running in the sandbox (``mode`` ``"functions"`` or ``"stdio"``).

    Use as a context manager: the program is killed and reaped on exit."""

    def __init__(self, sandbox: Sandbox, limits: Limits, mode: str, code: str) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_seconds
        self.requests = 0
        self.names: dict[str, str] = {}
        self.ended: str | None = None
        self._workdir = tempfile.TemporaryDirectory(prefix="rollout-code-")
        os.chmod(self._workdir.name, 0o711)
        self._errors = tempfile.TemporaryFile()
        self.channel, theirs = socket.socketpair()
        try:
            self.running = self._start(sandbox, theirs)
        except BaseException:
            self._release()
            raise
        finally:
            theirs.close()
        try:
            self._handshake(mode, code)
        except BaseException:
            self.close()
            raise

    def _start(self, sandbox: Sandbox, theirs: socket.socket) -> Running:
        bubblewrap = sandbox.kind == "bubblewrap"
        directory = HARNESS_DIR if bubblewrap else str(HERE)
        files = [(str(HERE / name), f"{HARNESS_DIR}/{name}") for name in HARNESS_FILES] if bubblewrap else []
        argv = [interpreter(), "-I", "-S", "-c", BOOT.format(directory=directory), str(theirs.fileno())]
        limits = self.limits
        return sandbox.start(
            argv,
            cwd=Path(self._workdir.name),
            scratch_bytes=limits.scratch_mb << 20,
            memory_bytes=(limits.memory_mb + limits.scratch_mb) << 20,
            files=files,
            pass_fds=(theirs.fileno(),),
            stderr=self._errors,
        )

    def _handshake(self, mode: str, code: str) -> None:
        try:
            seccomp = self.limits.seccomp.hex() if self.limits.seccomp else ""
            start = {"mode": mode, "code": code, "limits": self.limits.for_harness(), "seccomp": seccomp}
            write_frame(self.channel, start)
            ready = self._receive()
        except (ProgramEnded, ChannelBroken, OSError) as err:
            raise HarnessDidNotStart(
                f"the sandboxed harness did not start: {self._stderr() or err}"
            ) from None
        if ready != {"op": "ready"}:
            raise HarnessDidNotStart(f"the sandboxed harness did not start: it said {ready!r:.200}")
        if mode == "functions":
            try:
                loaded = self._receive()
            except ProgramEnded:  # the code crashed, exited or ran out of time as it loaded
                return
            names = loaded.get("names", {})
            if loaded.get("op") != "loaded" or not isinstance(names, dict):
                raise ChannelBroken(f"expected the loaded names, got {loaded!r:.200}")
            self.names = {str(name): str(kind) for name, kind in names.items()}

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Sends one request and returns its answer (a frame with the same id)."""
        if self.ended is not None:
            raise ProgramEnded(self.ended)
        self.requests += 1
        if self.requests > self.limits.max_requests:
            self._end(f"made more than {self.limits.max_requests} requests")
        call_id = self.requests
        try:
            write_frame(self.channel, {"id": call_id, "op": op, **fields})
        except OSError:
            self._end("exited")
        answer = self._receive()
        if answer.get("id") != call_id:
            self._stop("its channel broke")
            raise ChannelBroken(f"an answer to request {answer.get('id')!r:.40} where {call_id} was due")
        return answer

    def _receive(self) -> dict[str, Any]:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            self._end(f"ran past its {self.limits.timeout_seconds} s")
        self.channel.settimeout(remaining)
        try:
            message = read_frame(self.channel, self.limits.max_value_bytes)
        except TimeoutError:
            self._end(f"ran past its {self.limits.timeout_seconds} s")
        except FrameError as err:
            self._stop("its channel broke")
            raise ChannelBroken(str(err)) from None
        except OSError:
            message = None
        if message is None:
            self._end("exited")
        return message

    def _end(self, why: str) -> Any:
        self._stop(why)
        raise ProgramEnded(why)

    def _stop(self, why: str) -> None:
        self.ended = why
        self.running.stop()

    def _stderr(self) -> str:
        self._errors.seek(0)
        return self._errors.read(2000).decode("utf-8", "replace").strip()

    def close(self) -> None:
        if self.ended is None:
            self.ended = "closed"
        self.running.stop()
        self._release()

    def _release(self) -> None:
        self.channel.close()
        self._errors.close()
        self._workdir.cleanup()

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_stdio_case(program: Program, stdin: str) -> tuple[str, str] | None:
    """The program's output and outcome (``"exited"`` or ``"raised"``) on ``stdin``, or
    ``None`` when the program is gone."""
    try:
        answer = program.request("stdio", stdin=stdin)
    except ProgramEnded:
        return None
    stdout, outcome = answer.get("stdout"), answer.get("outcome")
    if not isinstance(stdout, str) or outcome not in ("exited", "raised"):
        raise ChannelBroken(f"a malformed answer to a stdio case: {answer!r:.200}")
    return stdout, outcome
