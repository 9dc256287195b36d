"""Prompt data: a JSONL source and small transforms that compose in a pipeline."""

from __future__ import annotations

import dataclasses
import json
import string
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rollout_sdk import DataSource, Record, Transform

__all__ = [
    "DropLongPrompts",
    "JsonlPrompts",
    "Template",
    "check_template",
    "jsonl_objects",
    "render_template",
]


class JsonlPrompts(DataSource):
    """One record per line of a JSONL file, with ``prompt`` rendered from ``template``.

    The template is a ``str.format`` string over the record's fields (``"Q: {question}"``);
    every field of the line is kept next to the rendered ``prompt``.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        path: str
        template: str = "{prompt}"
        # 0 reads every line.
        limit: int = 0

        def __post_init__(self) -> None:
            check_template(self.template)
            if self.limit < 0:
                raise ValueError(f"limit must be 0 (all) or positive, got {self.limit}")

    def __init__(self, config: JsonlPrompts.Config) -> None:
        super().__init__(config)
        self.path = Path(config.path)
        if not self.path.is_file():
            raise FileNotFoundError(f"JsonlPrompts: no such file: {self.path}")

    def records(self) -> Iterator[Record]:
        for record, where in jsonl_objects(self.path, self.config.limit):
            yield {**record, "prompt": render_template(self.config.template, record, where)}


def jsonl_objects(path: Path, limit: int = 0) -> Iterator[tuple[dict[str, Any], str]]:
    """Each non-blank line of ``path`` as a JSON object, with its ``file:line`` for errors;
    at most ``limit`` of them (0: all)."""
    produced = 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            yield _parse_object(line, where), where
            produced += 1
            if produced == limit:
                return


def _parse_object(line: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


class Template(Transform):
    """Set ``record[target]`` to ``template`` rendered over the record's fields."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        template: str
        target: str = "prompt"

        def __post_init__(self) -> None:
            check_template(self.template)

    def __call__(self, record: Record) -> Record:
        rendered = render_template(self.config.template, record, "Template")
        return {**record, self.config.target: rendered}


class DropLongPrompts(Transform):
    """Drop records whose ``prompt`` is longer than ``max_chars`` characters."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        max_chars: int

        def __post_init__(self) -> None:
            if self.max_chars <= 0:
                raise ValueError(f"max_chars must be positive, got {self.max_chars}")

    def __call__(self, record: Record) -> Record | None:
        if "prompt" not in record:
            raise KeyError("DropLongPrompts: the record has no `prompt` field")
        return None if len(record["prompt"]) > self.config.max_chars else record


class WrongAnswerPairs(Transform):
    """Preference pairs for DPO from question/answer records.

    ``chosen`` is the answer; ``rejected`` is the same answer with its last digit changed
    (deterministically, by the answer's CRC), so the pair differs in exactly one token.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        answer_key: str = "answer"

    def __call__(self, record: Record) -> Record:
        answer = str(record[self.config.answer_key])
        digits = [index for index, char in enumerate(answer) if char.isdigit()]
        if not digits:
            raise ValueError(f"WrongAnswerPairs: the answer {answer!r} has no digit to change")
        index = digits[-1]
        shift = 1 + zlib.crc32(answer.encode()) % 9
        wrong = str((int(answer[index]) + shift) % 10)
        return {**record, "chosen": answer, "rejected": answer[:index] + wrong + answer[index + 1 :]}


def check_template(template: str) -> None:
    """Raise ValueError unless ``template`` is a format string with only named fields."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ValueError(f"template {template!r} is not a valid format string: {err}") from None
    if any(name == "" or name.isdigit() for name in fields):
        raise ValueError(f"template {template!r} must name its fields, like {{question}}")


def render_template(template: str, record: Mapping[str, Any], where: str) -> str:
    """``template.format_map(record)``, with a KeyError naming the missing field and ``where``."""
    try:
        return template.format_map(record)
    except KeyError as err:
        fields = ", ".join(f"`{key}`" for key in record) or "none"
        raise KeyError(
            f"{where}: the template needs field `{err.args[0]}`, which the record lacks (it has {fields})"
        ) from None
