"""Tests of completed code, evaluated outside the code's sandbox.

A test is a program (HumanEval's ``def check(candidate): ...``, called with the function under
test, or statements with ``assert`` in them, passing when it runs to its end), or one ``assert`` of
any expression (``assert add(1, 2) == 3 and add(2, 2) == 4``,
``assert all(add(a, b) == a + b for a, b in pairs)``, ``assert abs(area(2.0) - 12.566) < 1e-3``,
``assert math.isclose(area(2.0), 12.566, rel_tol=1e-3)``, ``assert my_sort(x) == sorted(x)``,
``assert zeros(3) == [0] * 3``...). The whole expression is evaluated here, in a namespace this
process owns (:func:`namespace`): its own built-ins and modules, whatever the completion
defines, so ``abs``, ``all``, ``sorted``, ``math`` and every comparison are always the real
ones. Only the names the completion defines and the test does not get from here (its
functions, classes and values) reach into the sandbox, as proxies
(``python_plugins/code_proxies.py``) that return plain values of exact built-in types.

Tests come from the dataset, not from the completion, and they run in this process:
:func:`parse_test` refuses the forms that reach past plain values (attributes starting with
``_``, the introspection attributes of frames, generators and code, names starting with
``__``, classes, decorators, ``with``, ``global``) and the namespace has no ``getattr``,
``open``, ``eval``, real ``import`` or module that leads to others. This keeps a careless
dataset from doing harm. The test's own Python code stops at the sample's deadline (so a loop
over a huge value the completion returned cannot hang the reward); a single built-in call on
such a value (``sum(range(f()))``), or a hostile dataset (``2 ** 10 ** 10``), could still slow a
run down, as any data pipeline its author wrote could.
"""

from __future__ import annotations

import ast
import bisect
import builtins
import cmath
import collections
import decimal
import fractions
import functools
import heapq
import itertools
import json
import math
import random
import re
import statistics
import string
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from types import CodeType, FrameType, SimpleNamespace
from typing import Any

__all__ = ["BUILTINS", "Test", "TestTimeout", "UnverifiableTest", "evaluate", "namespace", "parse_test"]

_SAFE_BUILTIN_NAMES = (
    "abs all any ascii bin bool bytearray bytes callable chr complex dict divmod enumerate filter "
    "float format frozenset hash hex int isinstance issubclass iter len list map max min next oct "
    "ord pow range repr reversed round set slice sorted str sum tuple type zip "
    "ArithmeticError AssertionError AttributeError Exception IndexError KeyError LookupError "
    "NotImplementedError OverflowError RecursionError RuntimeError StopIteration TypeError "
    "ValueError ZeroDivisionError"
).split()
#: The built-ins a test may use (no ``getattr``, ``open``, ``eval``, ``__import__``...).
BUILTINS: dict[str, Any] = {name: getattr(builtins, name) for name in _SAFE_BUILTIN_NAMES}

_MODULE_NAMES: dict[str, Any] = {
    "math": (math, None),
    "cmath": (cmath, None),
    "itertools": (itertools, None),
    "statistics": (
        statistics,
        "mean median median_low median_high mode multimode pstdev pvariance "
        "stdev variance fmean geometric_mean harmonic_mean quantiles",
    ),
    "fractions": (fractions, "Fraction"),
    "decimal": (decimal, "Decimal"),
    "functools": (functools, "reduce partial cmp_to_key"),
    "collections": (collections, "Counter defaultdict OrderedDict deque namedtuple ChainMap"),
    "heapq": (heapq, "heappush heappop heapify heappushpop heapreplace nlargest nsmallest merge"),
    "bisect": (bisect, "bisect bisect_left bisect_right insort insort_left insort_right"),
    "re": (
        re,
        "match search fullmatch findall finditer sub subn split compile escape "
        "I IGNORECASE M MULTILINE S DOTALL X VERBOSE A ASCII",
    ),
    "json": (json, "loads dumps"),
    "string": (
        string,
        "ascii_letters ascii_lowercase ascii_uppercase digits hexdigits octdigits "
        "punctuation printable whitespace",
    ),
}
_RANDOM_METHODS = "random randint randrange choice choices shuffle sample uniform gauss seed".split()
# Attributes that lead from a value to frames, code or globals without an underscore.
_INTROSPECTION_PREFIXES = ("gi_", "cr_", "ag_", "f_", "tb_", "co_", "func_", "im_")


class UnverifiableTest(ValueError):
    """A test that cannot be evaluated safely outside the sandbox."""


def _facade(module: Any, names: str | None) -> SimpleNamespace:
    """``module``'s public functions, classes and constants, and no module it imports."""
    chosen = names.split() if names else [n for n in dir(module) if not n.startswith("_")]
    values = {name: getattr(module, name) for name in chosen}
    return SimpleNamespace(**{k: v for k, v in values.items() if type(v).__name__ != "module"})


MODULES: dict[str, SimpleNamespace] = {name: _facade(*spec) for name, spec in _MODULE_NAMES.items()}


@dataclass(frozen=True, slots=True)
class Test:
    """One test: its source and its compiled code, an expression (one ``assert``) or a
    program (HumanEval's ``def check(candidate): ...``, or several statements)."""

    source: str
    code: CodeType
    program: bool = False
    #: A program that defines ``check(candidate)``, to be called with the function under test.
    calls_check: bool = False


# The statements a test program may hold: no class, no `with`, no `global`, no decorators.
_STATEMENTS = (
    ast.Assert, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.For, ast.While, ast.If,
    ast.Pass, ast.Break, ast.Continue, ast.FunctionDef, ast.Return, ast.Import, ast.ImportFrom,
    ast.Try, ast.Raise, ast.Delete,
)  # fmt: skip


@lru_cache(maxsize=4096)
def parse_test(source: str) -> Test:
    """The test in ``source``, checked and compiled; :class:`UnverifiableTest` says why it is
    refused. One ``assert`` is an expression test (its message is ignored); anything else is a
    program, which passes when it runs to its end (every ``assert`` in it holding)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise UnverifiableTest(f"not Python: {err.msg}") from None
    if not tree.body:
        raise UnverifiableTest("holds no test")
    for node in ast.walk(tree):
        _check_node(node)
    if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert):
        expression = ast.Expression(tree.body[0].test)
        return Test(source=source, code=compile(expression, "<test>", "eval"))
    calls_check = any(
        isinstance(node, ast.FunctionDef) and node.name == "check" and len(node.args.args) == 1
        for node in tree.body
    )
    return Test(source=source, code=compile(tree, "<test>", "exec"), program=True, calls_check=calls_check)


def _check_node(node: ast.AST) -> None:
    if isinstance(node, ast.stmt) and not isinstance(node, _STATEMENTS):
        raise UnverifiableTest(f"holds a `{type(node).__name__}` statement")
    if isinstance(node, ast.FunctionDef) and node.decorator_list:
        raise UnverifiableTest("decorates a function")
    if isinstance(node, ast.Attribute) and (
        node.attr.startswith("_") or node.attr.startswith(_INTROSPECTION_PREFIXES)
    ):
        raise UnverifiableTest(f"reads the attribute `{node.attr}`, which leads past plain values")
    if isinstance(node, ast.Name) and node.id.startswith("__"):
        raise UnverifiableTest(f"uses the name `{node.id}`")
    if isinstance(node, ast.Await | ast.Yield | ast.YieldFrom):
        raise UnverifiableTest("awaits or yields")


def namespace(completion: Mapping[str, Any], entry_points: Iterable[str] = ()) -> dict[str, Any]:
    """The globals a test is evaluated in: this process's built-ins and modules, then the
    completion's names (proxies) where the test does not get them from here; ``entry_points``
    (the record's names of the functions under test) are the completion's even where they
    shadow one of ours, and the first is also ``candidate``, for HumanEval's ``check``."""
    modules = {**MODULES, "random": _random_facade()}
    scope: dict[str, Any] = dict(completion)
    scope.update(modules)
    scope.update(BUILTINS)
    for name in entry_points:
        if name in completion:
            scope[name] = completion[name]
            scope.setdefault(CANDIDATE, completion[name])
    scope["__builtins__"] = {**BUILTINS, "__import__": _importer(modules)}
    return scope


CANDIDATE = "candidate"


def _importer(modules: Mapping[str, SimpleNamespace]) -> Any:
    """``import`` in a test program: the test's own module facades, and nothing else."""

    def import_(name: str, *args: Any, **kwargs: Any) -> SimpleNamespace:
        if name not in modules:
            raise ImportError(f"a test may import only {', '.join(sorted(modules))}")
        return modules[name]

    return import_


def _random_facade() -> SimpleNamespace:
    """A generator of the test's own (seeded as ``random.seed(0)``), not the process's."""
    generator = random.Random(0)
    methods = {name: getattr(generator, name) for name in _RANDOM_METHODS}
    return SimpleNamespace(**methods, Random=random.Random)


def evaluate(test: Test, scope: dict[str, Any], deadline: float) -> bool:
    """Whether ``test`` holds in ``scope``. Exceptions raised while evaluating it propagate
    (the caller decides which fail the test and which the sample), :class:`TestTimeout` among
    them once the test's own Python code runs past ``deadline`` (``time.monotonic()``)."""
    with _deadline(deadline):
        if not test.program:
            return bool(eval(test.code, scope))  # the test's own expression, checked by parse_test
        exec(test.code, scope)  # the test's own program, checked by parse_test
        if test.calls_check:
            if CANDIDATE not in scope:
                raise UnverifiableTest("calls check(candidate), but the record names no entry point")
            scope["check"](scope[CANDIDATE])
        return True


class TestTimeout(Exception):
    """The test's own code ran past the sample's deadline (a loop over a huge value)."""


@contextmanager
def _deadline(deadline: float) -> Iterator[None]:
    """Line tracing of the test's code (compiled as ``<test>``) that raises
    :class:`TestTimeout` past ``deadline``; built-in calls are not interrupted."""

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != "<test>":
            return None
        if time.monotonic() > deadline:
            raise TestTimeout("the test ran past the sample's deadline")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)
