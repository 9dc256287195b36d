"""The completion's names as the tests see them: proxies that reach into the sandbox.

Calling a :class:`SandboxFunction` sends the call, with its arguments as plain data, to the
harness and returns what came back: a plain value of an exact built-in type, or a
:class:`SandboxObject` for anything else (an instance, a generator, a function), which stays
in the sandbox. A sandbox object can be called, iterated (``list(gen(3))``) and have its
public attributes read (``Stack().push``); it has no truth value, length or comparison of its
own, so whatever the completion's objects claim about themselves decides nothing here. An
exception in the sandbox arrives as :class:`SandboxRaised`.

Arguments are plain data, sandbox objects and functions (passed back by reference), and this
process's built-in functions by name (``key=len``). Anything else (a lambda of the test, a
module's function) would have to run in the sandbox on the test's behalf, so the test is
refused (:class:`UnverifiableTest`), never scored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from python_plugins.code_checks import BUILTINS, UnverifiableTest
from python_plugins.code_session import ChannelBroken, Program
from python_plugins.code_wire import Budget, ValueRefused, decode, encode

__all__ = ["SandboxFunction", "SandboxObject", "SandboxRaised", "proxies"]

_BUILTIN_NAMES = {id(value): name for name, value in BUILTINS.items() if callable(value)}


class SandboxRaised(Exception):
    """The completion's code raised (the name of its exception type), or the value it
    returned was refused."""


class SandboxFunction:
    """A function, class or other callable the completion defined at the top level."""

    __slots__ = ("_name", "_program")

    def __init__(self, program: Program, name: str) -> None:
        self._program = program
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _ask(self._program, "call", name=self._name, **_arguments(self._program, args, kwargs))

    def __repr__(self) -> str:
        return f"<the completion's {self._name}>"


class SandboxObject:
    """An object that stays in the sandbox, by its handle there."""

    __slots__ = ("_handle", "_program")

    def __init__(self, program: Program, handle: int) -> None:
        self._program = program
        self._handle = handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _ask(self._program, "call", handle=self._handle, **_arguments(self._program, args, kwargs))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _ask(self._program, "getattr", handle=self._handle, attr=name)

    def __iter__(self) -> Any:
        return _ask(self._program, "iter", handle=self._handle)

    def __next__(self) -> Any:
        return _ask(self._program, "next", handle=self._handle)

    def __bool__(self) -> bool:
        raise TypeError("an object of the completion's has no truth value outside the sandbox")

    def __repr__(self) -> str:
        return f"<the completion's object {self._handle}>"


def proxies(program: Program) -> dict[str, Any]:
    """The completion's top-level names: callables as :class:`SandboxFunction`, other values
    fetched once (plain data, or a :class:`SandboxObject`)."""
    found: dict[str, Any] = {}
    for name, kind in program.names.items():
        if kind == "callable":
            found[name] = SandboxFunction(program, name)
        else:
            try:
                found[name] = _ask(program, "get", name=name)
            except SandboxRaised:
                continue
    return found


def _ask(program: Program, op: str, **fields: Any) -> Any:
    answer = program.request(op, **fields)
    if "value" in answer:
        try:
            return decode(answer["value"], Budget(items=program.limits.max_value_items), _handle_of(program))
        except ValueRefused as err:
            raise SandboxRaised(f"ValueRefused: {err}") from None
    if op == "next" and answer.get("stop") is True:
        raise StopIteration
    if isinstance(answer.get("raised"), str):
        raise SandboxRaised(answer["raised"][:200])
    raise ChannelBroken(f"a malformed answer to {op}: {answer!r:.200}")


def _handle_of(program: Program) -> Any:
    def build(tag: str, data: Any) -> SandboxObject:
        if tag == "handle" and type(data) is int and data >= 0:
            return SandboxObject(program, data)
        raise ValueRefused(f"a value tagged {tag!r}")

    return build


def _arguments(program: Program, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    def other(value: Any) -> list[Any]:
        if isinstance(value, SandboxObject) and value._program is program:
            return ["handle", value._handle]
        if isinstance(value, SandboxFunction) and value._program is program:
            return ["name", value._name]
        name = _BUILTIN_NAMES.get(id(value))
        if name is not None:
            return ["builtin", name]
        raise UnverifiableTest(
            f"passes {type(value).__name__} {value!r:.60} to the completion's code, which would "
            "then run it on the test's behalf"
        )

    budget = Budget(items=1 << 30)
    try:
        return {
            "args": [encode(value, budget, other) for value in args],
            "kwargs": {str(key): encode(value, budget, other) for key, value in kwargs.items()},
        }
    except ValueRefused as err:
        raise UnverifiableTest(f"passes a value that is not plain data: {err}") from None
