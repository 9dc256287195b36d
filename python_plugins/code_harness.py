"""The program a code reward runs inside the sandbox, around one completion's code.

It runs in a bare interpreter (``python -I -S``, standard library only) with ``code_wire.py``
beside it, and talks to the reward over one socket (its descriptor number is ``argv[1]``),
in frames (``code_wire``):

1. it reads ``{"mode", "code", "limits", "seccomp"}``, limits itself (address space, CPU
   seconds, file size, open files, no core dumps, no new processes), installs the seccomp
   filter it was given (``rollout_sdk/seccomp.py``), points descriptors 0, 1 and 2 at
   ``/dev/null`` and answers ``{"op": "ready"}`` before any of the completion's code runs;
2. ``mode = "functions"``: it runs the code as ``__main__`` and answers
   ``{"op": "loaded", "names": {name: "callable" | "value"}}`` (or ``"error"``: the exception's
   type), then answers requests, one at a time, each ``{"id", "op", ...}``:

   - ``call`` a name (``"name"``) or a handle (``"handle"``) with ``args`` and ``kwargs``;
   - ``get`` a name's value; ``getattr`` of a handle (``"attr"``, never one starting with
     ``_``); ``iter`` a handle; ``next`` of a handle (``{"stop": true}`` at its end);

   each answered ``{"id", "value": <tagged>}`` for plain data, ``{"id", "handle": n}`` for any
   other object (it stays here; the reward may call it, iterate it or read its attributes), or
   ``{"id", "raised": "<type>"}``. Arguments may hold handles, the completion's own names
   (``["name", n]``) and built-ins by name (``["builtin", n]``);
3. ``mode = "stdio"``: each ``{"id", "op": "stdio", "stdin"}`` runs the code afresh with that
   text on descriptor 0 and answers ``{"id", "stdout", "outcome": "exited" | "raised"}``.

It decides nothing: the tests are evaluated by the reward, outside the sandbox, on the values
it sends. Whatever the completion writes to the socket is read as what its functions returned.
"""

from __future__ import annotations

import builtins
import os
import resource
import signal
import socket
import sys
from typing import Any

from code_wire import Budget, ValueRefused, decode, encode, frame_bytes, read_frame, write_frame

MAX_REQUEST_BYTES = 64 << 20
MAX_HANDLES = 10_000


def set_limits(limits: dict[str, int]) -> None:
    memory = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    # The hard limit leaves room for the harness's own stdin file (stdio mode).
    size = limits["max_file_bytes"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, max(size, limits["max_value_bytes"])))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    # A write past the file-size limit fails with EFBIG rather than killing the program.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def install_seccomp(program: bytes) -> None:
    """Installs the reward's seccomp filter on this process (and whatever it would start):
    from here on the calls it denies fail. ``OSError`` if the kernel refuses it."""
    import ctypes

    class Program(ctypes.Structure):
        _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))

    buffer = ctypes.create_string_buffer(program, len(program))
    filter_program = Program(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(filter_program), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


def quiet_standard_streams() -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


class Harness:
    """The completion's namespace and the objects handed out as handles."""

    def __init__(self, channel: socket.socket, limits: dict[str, int]) -> None:
        self.channel = channel
        self.max_answer_bytes = limits["max_value_bytes"]
        self.max_items = limits["max_value_items"]
        self.namespace: dict[str, Any] = {}
        self.handles: list[Any] = []
        self.builtins = dict(builtins.__dict__)
        self.builtins.setdefault("exit", sys.exit)
        self.builtins.setdefault("quit", sys.exit)

    def fresh_namespace(self) -> dict[str, Any]:
        return {"__name__": "__main__", "__builtins__": dict(self.builtins)}

    def load(self, code: str) -> dict[str, Any]:
        self.namespace = self.fresh_namespace()
        try:
            exec(compile(code, "solution.py", "exec"), self.namespace)
        except BaseException as err:  # the code's own failure: its tests will fail
            return {"op": "loaded", "error": type(err).__name__}
        names = {}
        for name, value in list(self.namespace.items()):
            if name.startswith("_") or type(value).__name__ == "module":
                continue
            names[name] = "callable" if callable(value) else "value"
        return {"op": "loaded", "names": names}

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        call_id = request.get("id")
        try:
            result = self.perform(request)
        except StopIteration:
            return {"id": call_id, "stop": True}
        except BaseException as err:
            return {"id": call_id, "raised": type(err).__name__}
        return {"id": call_id, **self.describe(result)}

    def perform(self, request: dict[str, Any]) -> Any:
        op = request["op"]
        if op == "get":
            return self.namespace[request["name"]]
        target = self.handles[request["handle"]] if "handle" in request else self.namespace[request["name"]]
        if op == "call":
            args = [self.argument(value) for value in request["args"]]
            kwargs = {key: self.argument(value) for key, value in request["kwargs"].items()}
            return target(*args, **kwargs)
        if op == "getattr" and not str(request["attr"]).startswith("_"):
            return getattr(target, request["attr"])
        if op == "iter":
            return iter(target)
        if op == "next":
            return next(target)
        raise ValueError(f"unknown request {op!r}")

    def argument(self, encoded: Any) -> Any:
        return decode(encoded, Budget(items=1 << 30), self.argument_handle)

    def argument_handle(self, tag: str, data: Any) -> Any:
        if tag == "handle":
            return self.handles[data]
        if tag == "name":
            return self.namespace[data]
        if tag == "builtin":
            return self.builtins[data]
        raise ValueRefused(f"unknown tag {tag!r}")

    def describe(self, value: Any) -> dict[str, Any]:
        """``value`` as plain data, or as a new handle."""
        try:
            answer = {"value": encode(value, Budget(items=self.max_items), self.handle)}
        except ValueRefused as err:
            return {"raised": f"ValueRefused: {err}"}
        if frame_bytes(answer) > self.max_answer_bytes:
            return {"raised": "ValueRefused: a value larger than the cap"}
        return answer

    def handle(self, value: Any) -> list[Any]:
        if len(self.handles) >= MAX_HANDLES:
            raise ValueRefused("too many objects handed out")
        self.handles.append(value)
        return ["handle", len(self.handles) - 1]

    def run_stdio(self, request: dict[str, Any], code: str) -> dict[str, Any]:
        """Runs ``code`` afresh with ``request["stdin"]`` as descriptor 0 and its descriptor 1
        captured, in files of the work directory; the captured text is the answer."""
        _write_input(STDIN_FILE, request["stdin"])
        for fd, path, flags in (
            (0, STDIN_FILE, os.O_RDONLY),
            (1, STDOUT_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o600)
            if opened != fd:  # the code may have closed `fd`, which `open` then reuses
                os.dup2(opened, fd)
                os.close(opened)
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        outcome = "exited"
        try:
            exec(compile(code, "solution.py", "exec"), self.fresh_namespace())
            sys.stdout.flush()
        except SystemExit as exit_:
            outcome = "exited" if exit_.code in (None, 0) else "raised"
        except BaseException:
            outcome = "raised"
        try:
            sys.stdout.flush()
        except BaseException:
            outcome = "raised"
        with open(STDOUT_FILE, "rb") as captured:
            text = captured.read(self.max_answer_bytes).decode("utf-8", "replace")
        answer = {"id": request.get("id"), "stdout": text, "outcome": outcome}
        while frame_bytes(answer) > self.max_answer_bytes:
            answer["stdout"] = answer["stdout"][: len(answer["stdout"]) // 2]
        return answer


# In the working directory: a tmpfs of the sandbox's own, or a directory of this sample's.
STDIN_FILE, STDOUT_FILE = ".stdin", ".stdout"


def _write_input(path: str, text: str) -> None:
    """Writes the case's input, raising the file-size limit to the hard limit meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    try:
        with open(path, "w", encoding="utf-8") as stdin:
            stdin.write(text)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def serve(channel: socket.socket) -> None:
    start = read_frame(channel, MAX_REQUEST_BYTES)
    if start is None:
        return
    limits = start["limits"]
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    set_limits(limits)
    if start.get("seccomp"):
        install_seccomp(bytes.fromhex(start["seccomp"]))
    quiet_standard_streams()
    harness = Harness(channel, limits)
    write_frame(channel, {"op": "ready"})
    code = start["code"]
    if start["mode"] == "functions":
        write_frame(channel, harness.load(code))
    while (request := read_frame(channel, MAX_REQUEST_BYTES)) is not None:
        if start["mode"] == "stdio":
            write_frame(channel, harness.run_stdio(request, code))
        else:
            write_frame(channel, harness.answer(request))


def main() -> None:
    channel = socket.socket(fileno=int(sys.argv[1]))
    try:
        serve(channel)
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
