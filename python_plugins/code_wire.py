"""The wire between a code reward and the harness that runs a completion in its sandbox.

Standard library only: the same file is the harness's (``code_harness.py``, which runs in a
bare interpreter inside the sandbox) and the reward's. Messages are frames: a 4-byte
big-endian length, then that many bytes of UTF-8 JSON. Values travel tagged by exact type,
``[tag, data]``:

``["none"]``, ``["bool", b]``, ``["int", "-0x1f"]`` (hex: linear to parse at any size),
``["float", "1.5"]`` (``repr``), ``["complex", [re, im]]``, ``["str", s]``, ``["bytes", hex]``,
``["list" | "tuple" | "set" | "frozenset", [items]]``, ``["dict", [[key, value], ...]]``,
``["handle", n]`` (an object that stays in the sandbox, see ``code_harness.py``) and, from the
reward only, ``["builtin", name]`` (a built-in function such as ``len``, passed by name).

The reader of a frame checks its length against its cap before reading it, and :func:`decode`
counts items and depth, and refuses sets and dicts whose keys share a hash too often (a
quadratic insert), before any value is built.
"""

from __future__ import annotations

import json
import socket
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Budget", "FrameError", "ValueRefused", "decode", "encode", "read_frame", "write_frame"]

HEADER = struct.Struct(">I")
MAX_DEPTH = 64
# Keys of one set or dict that may share a hash: honest data has a handful at most; a forged
# value with thousands of them would make every insert a scan.
MAX_SAME_HASH = 8
_PLAIN = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_BUILD: dict[str, Callable[[list[Any]], Any]] = {
    "list": list,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
}


class FrameError(RuntimeError):
    """The channel carried something that is not a frame of the protocol."""


class ValueRefused(ValueError):
    """A value that is not plain data within the budget."""


@dataclass(slots=True)
class Budget:
    """What one value may hold: items of every container together, and nesting depth."""

    items: int
    depth: int = MAX_DEPTH

    def spend(self, count: int) -> None:
        self.items -= count
        if self.items < 0:
            raise ValueRefused("a value with too many items")


def write_frame(channel: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    channel.sendall(HEADER.pack(len(body)) + body)


def frame_bytes(message: dict[str, Any]) -> int:
    return HEADER.size + len(json.dumps(message, separators=(",", ":")).encode())


def read_frame(channel: socket.socket, max_bytes: int) -> dict[str, Any] | None:
    """The next message, or ``None`` at a clean end of the stream. :class:`FrameError` for a
    length past ``max_bytes``, a torn frame or a body that is not a JSON object. Timeouts
    (``socket.timeout``) propagate."""
    header = _read_exactly(channel, HEADER.size, at_start=True)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    if length > max_bytes:
        raise FrameError(f"a frame of {length} bytes (the cap is {max_bytes})")
    body = _read_exactly(channel, length, at_start=False) or b""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as err:
        raise FrameError(f"a frame that is not JSON: {err}") from None
    if not isinstance(message, dict):
        raise FrameError("a frame that is not a JSON object")
    return message


def _read_exactly(channel: socket.socket, count: int, *, at_start: bool) -> bytes | None:
    chunks, got = [], 0
    while got < count:
        chunk = channel.recv(min(count - got, 1 << 20))
        if not chunk:
            if at_start and got == 0:
                return None
            raise FrameError(f"the stream ended inside a frame ({got} of {count} bytes)")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def encode(value: Any, budget: Budget, other: Callable[[Any], list[Any]]) -> list[Any]:
    """``value`` tagged by type. Instances of subclasses of the plain types are read as the
    base type's own data (their overridden methods are not called); anything else becomes
    ``other(value)``. :class:`ValueRefused` past the budget."""
    return _encode(value, budget, other, 0)


def _encode(value: Any, budget: Budget, other: Callable[[Any], list[Any]], depth: int) -> list[Any]:
    if depth > budget.depth:
        raise ValueRefused("a value nested too deep")
    budget.spend(1)
    if value is None:
        return ["none"]
    if value is True or value is False:
        return ["bool", value]
    for kind, encoder in _SCALARS:
        if isinstance(value, kind):
            return encoder(value)
    for kind, name in _PLAIN.items():
        if isinstance(value, kind):
            return [name, [_encode(item, budget, other, depth + 1) for item in kind.__iter__(value)]]
    if isinstance(value, dict):
        pairs = dict.items(value)
        return [
            "dict",
            [[_encode(k, budget, other, depth + 1), _encode(v, budget, other, depth + 1)] for k, v in pairs],
        ]
    return other(value)


_SCALARS: tuple[tuple[type, Callable[[Any], list[Any]]], ...] = (
    (int, lambda v: ["int", hex(int.__index__(v))]),
    (float, lambda v: ["float", float.__repr__(float.__float__(v))]),
    (
        complex,
        lambda v: [
            "complex",
            [float.__repr__(complex.__complex__(v).real), float.__repr__(complex.__complex__(v).imag)],
        ],
    ),
    (str, lambda v: ["str", str.__str__(v)]),
    (bytes, lambda v: ["bytes", bytes.hex(v)]),
)


def decode(encoded: Any, budget: Budget, other: Callable[[str, Any], Any]) -> Any:
    """The value ``encoded`` stands for, built of exact built-in types; tags other than the
    plain ones go to ``other(tag, data)``. :class:`ValueRefused` for anything malformed or
    past the budget."""
    return _decode(encoded, budget, other, 0)


def _decode(encoded: Any, budget: Budget, other: Callable[[str, Any], Any], depth: int) -> Any:
    if depth > budget.depth:
        raise ValueRefused("a value nested too deep")
    if not isinstance(encoded, list) or not encoded or not isinstance(encoded[0], str):
        raise ValueRefused("not an encoded value")
    budget.spend(1)
    tag, data = encoded[0], encoded[1] if len(encoded) > 1 else None
    try:
        return _decode_tagged(tag, data, budget, other, depth)
    except (TypeError, ValueError, OverflowError) as err:
        if isinstance(err, ValueRefused):
            raise
        raise ValueRefused(f"a malformed {tag}: {err}") from None


def _decode_tagged(tag: str, data: Any, budget: Budget, other: Callable[[str, Any], Any], depth: int) -> Any:
    match tag:
        case "none":
            return None
        case "bool" if isinstance(data, bool):
            return data
        case "int" if isinstance(data, str) and data.lstrip("-").startswith("0x"):
            return int(data, 16)
        case "float" if isinstance(data, str):
            return float(data)
        case "complex" if isinstance(data, list) and len(data) == 2:
            return complex(float(data[0]), float(data[1]))
        case "str" if isinstance(data, str):
            return data
        case "bytes" if isinstance(data, str):
            return bytes.fromhex(data)
        case "list" | "tuple" | "set" | "frozenset" if isinstance(data, list):
            items = [_decode(item, budget, other, depth + 1) for item in data]
            if tag in ("set", "frozenset"):
                _refuse_colliding(items)
            return _BUILD[tag](items)
        case "dict" if isinstance(data, list):
            pairs = [_pair(pair, budget, other, depth) for pair in data]
            _refuse_colliding([key for key, _ in pairs])
            return dict(pairs)
    return other(tag, data)


def _pair(pair: Any, budget: Budget, other: Callable[[str, Any], Any], depth: int) -> tuple[Any, Any]:
    if not isinstance(pair, list) or len(pair) != 2:
        raise ValueRefused("a malformed dict item")
    return _decode(pair[0], budget, other, depth + 1), _decode(pair[1], budget, other, depth + 1)


def _refuse_colliding(keys: list[Any]) -> None:
    """:class:`ValueRefused` if more than :data:`MAX_SAME_HASH` keys share a hash (an
    unhashable key raises ``TypeError``, as building the set would)."""
    if len(keys) <= MAX_SAME_HASH:
        return
    counts = Counter(hash(key) for key in keys)
    if max(counts.values()) > MAX_SAME_HASH:
        raise ValueRefused("a set or dict whose keys share one hash")
