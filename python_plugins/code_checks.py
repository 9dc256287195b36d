"""Tests of completed code whose verdict is computed outside the code's sandbox.

A test is one ``assert``: a comparison whose operands are expressions (``add(1, 2)``) or
literals (``3``, ``[1, 2]``), or an expression asserted true (``assert is_prime(7)``) or false
(``assert not is_prime(8)``). :func:`parse_test` splits it into *probes*, the expressions the
sandboxed code evaluates, and a check the reward applies to their values: the expected
literals never reach the sandbox, so code cannot read or forge them. Values come back as plain
data of exact types (:func:`decode` rebuilds them; an object whose ``__eq__`` always holds
cannot cross), and comparisons are Python's own on those values, as the ``assert`` would be.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Check", "UnverifiableTest", "decode", "parse_test"]

OPERATORS: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}


class UnverifiableTest(ValueError):
    """A test whose verdict could only be computed where the code runs."""


@dataclass(frozen=True, slots=True)
class Operand:
    """A literal (the expected side), or the index of a probe."""

    literal: Any = None
    probe: int | None = None


@dataclass(frozen=True, slots=True)
class Check:
    """What to evaluate in the sandbox (``probes``) and how to judge the values."""

    probes: tuple[str, ...]
    operands: tuple[Operand, ...]
    operators: tuple[Callable[[Any, Any], bool], ...]
    #: For a bare ``assert expr`` / ``assert not expr``: the truth the value must have.
    truth: bool | None = None

    def passed(self, values: list[Any]) -> bool:
        """The verdict on the probes' values (``values[i]`` for probe ``i``)."""
        if self.truth is not None:
            return bool(values[0]) is self.truth
        resolved = [values[o.probe] if o.probe is not None else o.literal for o in self.operands]
        return all(op(a, b) for op, a, b in zip(self.operators, resolved, resolved[1:], strict=False))


def parse_test(source: str) -> Check:
    """The check of one test; :class:`UnverifiableTest` for anything but one ``assert`` of
    the forms above."""
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise UnverifiableTest(f"not Python: {err.msg}") from err
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise UnverifiableTest("not a single `assert` statement")
    test = tree.body[0].test
    if isinstance(test, ast.Compare):
        probes: list[str] = []
        operands = []
        for node in (test.left, *test.comparators):
            literal = _literal(node)
            if literal is not _NOT_LITERAL:
                operands.append(Operand(literal=literal))
            else:
                operands.append(Operand(probe=len(probes)))
                probes.append(ast.unparse(node))
        operators = []
        for op in test.ops:
            if type(op) not in OPERATORS:
                raise UnverifiableTest(f"an unknown comparison {type(op).__name__}")
            operators.append(OPERATORS[type(op)])
        if not probes:
            raise UnverifiableTest("compares only literals")
        return Check(probes=tuple(probes), operands=tuple(operands), operators=tuple(operators))
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return Check(probes=(ast.unparse(test.operand),), operands=(), operators=(), truth=False)
    return Check(probes=(ast.unparse(test),), operands=(), operators=(), truth=True)


_NOT_LITERAL = object()


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


def decode(encoded: Any) -> Any:
    """The value the harness encoded (``[type, data]``); ``ValueError`` for anything else."""
    if not isinstance(encoded, list) or not encoded or not isinstance(encoded[0], str):
        raise ValueError(f"not an encoded value: {encoded!r:.80}")
    kind, data = encoded[0], encoded[1] if len(encoded) > 1 else None
    match kind:
        case "none":
            return None
        case "bool" if isinstance(data, bool):
            return data
        case "int" if isinstance(data, str):
            return int(data)
        case "float" if isinstance(data, str):
            return float(data)
        case "complex" if isinstance(data, list) and len(data) == 2:
            return complex(float(data[0]), float(data[1]))
        case "str" if isinstance(data, str):
            return data
        case "bytes" if isinstance(data, str):
            return bytes.fromhex(data)
        case "list" | "tuple" | "set" | "frozenset" if isinstance(data, list):
            items = [decode(item) for item in data]
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
        case "dict" if isinstance(data, list):
            return {decode(pair[0]): decode(pair[1]) for pair in data}
    raise ValueError(f"not an encoded value: {encoded!r:.80}")
