"""The wire between a code reward and its sandboxed harness: frames are capped before they are
read, values are capped before they are built, and only exact built-in types come out."""

from __future__ import annotations

import socket
import struct
import time
from collections import OrderedDict, namedtuple
from typing import Any

import pytest

from python_plugins.code_wire import (
    MAX_SAME_HASH,
    Budget,
    FrameError,
    ValueRefused,
    decode,
    encode,
    read_frame,
    write_frame,
)

MODULUS = (1 << 61) - 1  # ints equal modulo this hash alike


def no_other(value: Any) -> list[Any]:
    raise ValueRefused(f"not plain: {type(value).__name__}")


def no_tag(tag: str, data: Any) -> Any:
    raise ValueRefused(f"tag {tag}")


def round_trip(value: Any) -> Any:
    return decode(encode(value, Budget(items=10**6), no_other), Budget(items=10**6), no_tag)


@pytest.mark.parametrize(
    "value",
    [None, True, 0, -(10**5000), 1.5, float("-inf"), 2j, "é", b"\x00\xff", [1, (2, 3)], {1: {"a": [None]}},
     {frozenset({1, 2}), (1,)}],
    ids=lambda value: type(value).__name__,
)  # fmt: skip
def test_plain_values_round_trip_exactly(value: Any) -> None:
    back = round_trip(value)
    assert back == value
    assert type(back) is type(value)


def test_a_correct_answer_of_any_size_is_read_back() -> None:
    """The parent's `int()` digit limit (4300) does not apply: ints travel as hex."""
    huge = 7**20_000
    assert round_trip(huge) == huge


def test_subclasses_travel_as_their_base_types_whatever_they_override() -> None:
    class Liar(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

        def __index__(self) -> int:
            return 10**6

    Point = namedtuple("Point", "x y")
    values = [Liar(3), Point(1, 2), OrderedDict(a=1)]
    assert [round_trip(v) for v in values] == [3, (1, 2), {"a": 1}]
    assert [type(round_trip(v)) for v in values] == [int, tuple, dict]


def test_the_item_budget_is_spent_before_values_are_built() -> None:
    encoded = encode(list(range(1000)), Budget(items=10**6), no_other)
    with pytest.raises(ValueRefused, match="too many items"):
        decode(encoded, Budget(items=999), no_tag)
    deep: Any = ["none"]
    for _ in range(100):
        deep = ["list", [deep]]
    with pytest.raises(ValueRefused, match="too deep"):
        decode(deep, Budget(items=10**6), no_tag)


def test_sets_whose_items_share_a_hash_are_refused_quickly() -> None:
    colliding = [["int", hex(k * MODULUS)] for k in range(20_000)]
    started = time.monotonic()
    for tag in ("set", "frozenset"):
        with pytest.raises(ValueRefused, match="share one hash"):
            decode([tag, colliding], Budget(items=10**6), no_tag)
    pairs = [[item, ["none"]] for item in colliding]
    with pytest.raises(ValueRefused, match="share one hash"):
        decode(["dict", pairs], Budget(items=10**6), no_tag)
    # Building the set itself would take about 12 s on a 2-core CI machine (quadratic).
    assert time.monotonic() - started < 4.0
    few = [["int", hex(k * MODULUS)] for k in range(MAX_SAME_HASH)]
    assert len(decode(["set", few], Budget(items=10**6), no_tag)) == MAX_SAME_HASH


@pytest.mark.parametrize(
    "encoded",
    [["int", "12"], ["int", "0x"], ["float", 1.5], ["bool", 1], ["list", "abc"], ["dict", [[["none"]]]],
     ["complex", ["1"]], ["bytes", "zz"], ["nope", 1], [], "int", [["int", "0x1"]]],
)  # fmt: skip
def test_malformed_values_are_refused(encoded: Any) -> None:
    with pytest.raises(ValueRefused):
        decode(encoded, Budget(items=100), no_tag)


def test_a_length_claim_past_the_cap_is_refused_unread() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(struct.pack(">I", 0xFFFFFFFF))
        with pytest.raises(FrameError, match="4294967295 bytes"):
            read_frame(ours, 1 << 20)


@pytest.mark.parametrize(
    "payload",
    [
        struct.pack(">I", 10) + b"short",
        struct.pack(">I", 4) + b"[1]\n",
        struct.pack(">I", 3) + b"{x}",
        b"\x00\x00",
    ],
)
def test_torn_and_garbage_frames_are_errors(payload: bytes) -> None:
    ours, theirs = socket.socketpair()
    with ours:
        theirs.sendall(payload)
        theirs.close()
        with pytest.raises(FrameError):
            read_frame(ours, 1 << 20)


def test_frames_round_trip_and_a_clean_end_is_none() -> None:
    ours, theirs = socket.socketpair()
    with ours:
        write_frame(theirs, {"id": 1, "value": ["int", "0x3"]})
        theirs.close()
        assert read_frame(ours, 1024) == {"id": 1, "value": ["int", "0x3"]}
        assert read_frame(ours, 1024) is None
