"""The program ``python_plugins.code_reward`` runs (as ``python -I -S -c <this file>``, under the
OS sandbox) to run one completion's code. Standard library only: it runs in a bare interpreter.

It reads ``{"code", "probes", "limits"}`` as JSON from stdin and writes lines to stdout (a file
the reward reads afterwards):

1. ``started``, before any of the completion's code runs (so a harness that could not start is
   told apart from code that killed it);
2. one line per probe, in order: ``["ok", <value>]`` with the value encoded by type
   (:func:`encode`), or ``["raised", "<exception type>"]``.

It limits itself first (address space, CPU seconds, file size, open files, no core dumps, no
new processes), sends the completion's output to ``/dev/null`` and keeps a private copy of
stdout for the lines above. It decides nothing: the probes are the tests' expressions with the
expected values taken out, and the reward compares what comes back, outside the sandbox. Code
that writes its own lines can only guess values, as an honest program returning them would.
"""

from __future__ import annotations

import builtins
import json
import os
import resource
import sys
from typing import Any

# Bound before the completion runs, so that patching builtins cannot change how values are
# encoded.
_type, _str, _repr, _len, _list, _sorted = type, str, repr, len, list, sorted
MAX_DEPTH = 64


def set_limits(limits: dict[str, int]) -> None:
    memory = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    size = limits["max_file_bytes"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))


def private_stdout() -> Any:
    """A private copy of stdout for the harness's lines; fds 1 and 2 now go to /dev/null."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    return out


def encode(value: Any, depth: int = 0) -> list[Any]:
    """``value`` as ``[type, data]`` for plain data of exactly these types (subclasses, and
    anything else, raise ``TypeError``)."""
    if depth > MAX_DEPTH:
        raise TypeError("a value nested too deep")
    kind = _type(value)
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", value]
    if kind is int:
        return ["int", _str(value)]
    if kind is float:
        return ["float", _repr(value)]
    if kind is complex:
        return ["complex", [_repr(value.real), _repr(value.imag)]]
    if kind is str:
        return ["str", value]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind in (list, tuple, set, frozenset):
        items = [encode(item, depth + 1) for item in value]
        name = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}[kind]
        return [name, items]
    if kind is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    raise TypeError(f"a value of type {kind.__name__} is not plain data")


def run(code: str, probes: list[str], out: Any) -> None:
    pristine = dict(builtins.__dict__)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except BaseException:
        return
    for index, probe in enumerate(probes):
        scope = {**namespace, "__builtins__": pristine}
        try:
            value = eval(compile(probe, f"test_{index}.py", "eval"), scope)
            line = ["ok", encode(value)]
        except BaseException as err:
            line = ["raised", _type(err).__name__]
        out.write(json.dumps(line) + "\n")
        out.flush()


def main() -> None:
    payload = json.loads(sys.stdin.read())
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    set_limits(payload["limits"])
    out = private_stdout()
    out.write("started\n")
    out.flush()
    run(payload["code"], list(payload["probes"]), out)
    os._exit(0)


if __name__ == "__main__":
    main()
