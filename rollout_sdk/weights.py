"""Weights handed to a policy one tensor at a time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np


class StreamedWeights(Mapping[str, np.ndarray]):
    """A mapping of weights whose tensors are taken in one at a time as it is read: what a
    generation worker's ``Policy.import_weights`` is given in a weight sync.

    Iterating it (``items()``, ``for name in weights``) takes each tensor in when it is reached
    (in a sync, a read-only view of the received and verified bytes, made then), without
    building a dict of the whole version first, so a policy should copy each tensor as it
    iterates. Everything else a ``Mapping`` offers works too: looking up a name, ``len`` or
    ``in`` read on until that name (or every tensor) is in. An error of the source is raised
    where the mapping is read.
    """

    def __init__(self, source: Iterator[tuple[str, np.ndarray]]) -> None:
        self._source: Iterator[tuple[str, np.ndarray]] | None = source
        self._taken: dict[str, np.ndarray] = {}
        self._order: list[str] = []

    def _receive(self) -> bool:
        """Takes the next tensor in; False once every tensor is in."""
        if self._source is None:
            return False
        try:
            name, array = next(self._source)
        except StopIteration:
            self._source = None
            return False
        self._taken[name] = array
        self._order.append(name)
        return True

    def __iter__(self) -> Iterator[str]:
        index = 0
        while index < len(self._order) or self._receive():
            yield self._order[index]
            index += 1

    def __getitem__(self, name: str) -> np.ndarray:
        while name not in self._taken:
            if not self._receive():
                raise KeyError(name)
        return self._taken[name]

    def __len__(self) -> int:
        while self._receive():
            pass
        return len(self._order)
