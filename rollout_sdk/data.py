"""Data plugins: a source of prompt records and transforms that compose into a pipeline.

A record is a JSON-compatible mapping. After the pipeline it must hold a ``"prompt"`` string;
every other key travels with the sample as metadata (rewards read e.g. ``"answer"``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from rollout_sdk.plugin import Plugin

__all__ = ["DataSource", "Pipeline", "Record", "Transform"]

Record = Mapping[str, Any]


class DataSource(Plugin):
    def records(self) -> Iterable[Record]:
        """Yield the dataset's records in a fixed order (the engine shuffles, seeded)."""
        raise NotImplementedError


class Transform(Plugin):
    def __call__(self, record: Record) -> Record | None:
        """Return the transformed record, or ``None`` to drop it."""
        raise NotImplementedError


class Pipeline:
    """Transforms applied in order; a record dropped by one is not seen by the next."""

    def __init__(self, transforms: Sequence[Transform]) -> None:
        self.transforms = list(transforms)

    def __call__(self, records: Iterable[Record]) -> Iterator[Record]:
        for record in records:
            current: Record | None = record
            for transform in self.transforms:
                current = transform(current)
                if current is None:
                    break
            if current is not None:
                yield current
