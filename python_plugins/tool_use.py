"""A tool-use chat environment: the model answers arithmetic by calling a calculator tool.

The model calls ``<tool_call>{"name": "calc", "arguments": {"expr": "37*48"}}</tool_call>``;
the environment evaluates the expression with a small arithmetic parser (never ``eval``) and
answers with a ``tool`` message, rendered by the chat template. A turn without a tool call is
the final answer, scored against the record's ground truth: the model's text (and the tool's
output) never decides the score.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

from python_plugins.chat import ChatEnvironment, ChatReply, ToolCallError, parse_tool_calls
from python_plugins.rewards import answers_equal

__all__ = ["CALC_TOOL", "CalcError", "Calculator", "evaluate_arithmetic"]

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30
MAX_EXPONENT = 64

CALC_TOOL: Mapping[str, Any] = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string", "description": "e.g. 37*48"}},
            "required": ["expr"],
        },
    },
}


class CalcError(ValueError):
    """An expression the calculator refuses; the message says why."""


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression over int and float literals.

    Only literals, ``+ - * / // % **`` and parentheses are accepted (names, calls, attributes
    and everything else are refused); operands and results are bounded so no expression can
    take long or much memory. Raises :class:`CalcError` with the reason.
    """
    if not isinstance(expression, str):
        raise CalcError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError(f"cannot parse {expression[:60]!r} as arithmetic") from None
    try:
        return _evaluate(tree.body)
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except (OverflowError, RecursionError):
        raise CalcError("the result is too large") from None


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > MAX_MAGNITUDE):
            raise CalcError(f"exponents are limited to {MAX_EXPONENT}")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise CalcError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise CalcError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("the result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError("the result is too large")
    return value


def format_number(value: int | float) -> str:
    """An integer as its digits; a float to 10 significant digits, without trailing zeros."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


class Calculator(ChatEnvironment):
    """Answer ``record["messages"]`` (a conversation, usually one user question) with the
    ``calc`` tool; reward 1.0 when the final answer equals ``record[answer_key]``.

    A turn with tool calls gets one ``tool`` message per call (the result, or ``error: ...``
    for a malformed call, an unknown tool or a refused expression); the episode goes on. A
    turn without one is the final answer: it must be a number equal to the ground truth (and,
    with ``require_tool``, come after a tool result in the conversation), else reward 0.
    """

    tools = (CALC_TOOL,)

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        tokenizer: str
        system_prompt: str | None = None
        answer_key: str = "answer"
        messages_key: str = "messages"
        require_tool: bool = True
        # Turns with tool calls an episode may take before it ends unanswered.
        max_tool_turns: int = 2

        def __post_init__(self) -> None:
            if self.max_tool_turns < 1:
                raise ValueError(f"max_tool_turns must be at least 1, got {self.max_tool_turns}")

    def __init__(self, config: Calculator.Config) -> None:
        super().__init__(config)
        self.answer: str | None = None
        self.tool_turns = 0

    def start(self, record: Mapping[str, Any], *, seed: int) -> list[dict[str, str]]:
        for key in (self.config.messages_key, self.config.answer_key):
            if key not in record:
                raise KeyError(f"Calculator: the record has no `{key}` field")
        self.answer = str(record[self.config.answer_key])
        self.tool_turns = 0
        return list(record[self.config.messages_key])

    def reply(self, content: str) -> ChatReply:
        if self.answer is None:
            raise RuntimeError("Calculator.step needs a fresh episode: call reset first")
        try:
            calls = parse_tool_calls(content)
        except ToolCallError as err:
            return self._tool_turn([f"error: {err}"])
        if calls:
            results = []
            for call in calls:
                if call.name != "calc":
                    results.append(f"error: unknown tool {call.name[:40]!r}; the tool is calc")
                    continue
                try:
                    results.append(format_number(evaluate_arithmetic(call.arguments.get("expr"))))
                except CalcError as err:
                    results.append(f"error: {err}")
            return self._tool_turn(results)
        used_tool = any(message["role"] == "tool" for message in self.messages)
        correct = answers_equal(content.strip(), self.answer) and _is_number(content.strip())
        reward = 1.0 if correct and (used_tool or not self.config.require_tool) else 0.0
        return ChatReply(reward=reward, done=True, info={"tool_turns": self.tool_turns})

    def _tool_turn(self, results: list[str]) -> ChatReply:
        self.tool_turns += 1
        if self.tool_turns > self.config.max_tool_turns:
            return ChatReply(reward=0.0, done=True, info={"tool_turns": self.tool_turns})
        messages = [{"role": "tool", "content": result} for result in results]
        return ChatReply(messages=messages, info={"tool_turns": self.tool_turns})


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
