"""Prompt sources for columnar data: Parquet files and Hugging Face datasets saved to disk.

Both read in batches of ``batch_size`` rows (a large file is never loaded at once), render
``prompt`` from ``template`` like :class:`python_plugins.data.JsonlPrompts`, and turn every
value into its JSON form (see :func:`json_compatible`). Rows are counted from 0 in errors.
pyarrow and datasets are imported when a source is built, not with this module.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import glob
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from python_plugins.data import check_template, render_template
from rollout_sdk import DataSource, Record

__all__ = ["HFDiskDataset", "ParquetPrompts", "json_compatible"]


@dataclasses.dataclass(kw_only=True, slots=True)
class _ColumnarOptions:
    """The options both sources share."""

    template: str = "{prompt}"
    # Only these columns are read (and kept); empty: all.
    columns: list[str] = dataclasses.field(default_factory=list)
    # 0 reads every row.
    limit: int = 0
    # Rows read at a time.
    batch_size: int = 1024

    def __post_init__(self) -> None:
        check_template(self.template)
        if self.limit < 0:
            raise ValueError(f"limit must be 0 (all) or positive, got {self.limit}")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if len(set(self.columns)) != len(self.columns) or not all(self.columns):
            raise ValueError(f"columns must be distinct, non-empty names, got {self.columns}")
        if self.columns:
            unread = sorted(set(template_fields(self.template)) - set(self.columns))
            if unread:
                raise ValueError(f"the template needs {unread}, which `columns` does not read")


class ParquetPrompts(DataSource):
    """One record per row of one or more Parquet files, with ``prompt`` rendered from ``template``.

    ``path`` is a file, a directory (every ``*.parquet`` file under it) or a glob
    (``data/train-*.parquet``); files are read in sorted path order.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_ColumnarOptions):
        path: str

    def __init__(self, config: ParquetPrompts.Config) -> None:
        super().__init__(config)
        import pyarrow.parquet as pq  # only when the source is used

        self.files = parquet_files(config.path)
        for file in self.files:
            _check_columns(pq.read_schema(file).names, config.columns, str(file))

    def records(self) -> Iterator[Record]:
        import pyarrow.parquet as pq

        config = self.config
        batches = (
            (str(file), _parquet_batches(pq.ParquetFile(file), config.columns, config.batch_size))
            for file in self.files
        )
        yield from _render_rows(batches, config.template, config.limit)


def _parquet_batches(parquet: Any, columns: Sequence[str], batch_size: int) -> Iterator[list[dict[str, Any]]]:
    with parquet:
        for batch in parquet.iter_batches(batch_size=batch_size, columns=list(columns) or None):
            yield batch.to_pylist()


def parquet_files(path: str) -> list[Path]:
    """The Parquet files ``path`` names: a file, a directory's ``*.parquet`` files, or a glob."""
    given = Path(path)
    if given.is_file():
        return [given]
    if given.is_dir():
        files = sorted(file for file in given.rglob("*.parquet") if file.is_file())
        if not files:
            raise FileNotFoundError(f"ParquetPrompts: no *.parquet file under {given}")
        return files
    if glob.has_magic(path):
        files = sorted(Path(file) for file in glob.glob(path, recursive=True) if Path(file).is_file())
        if not files:
            raise FileNotFoundError(f"ParquetPrompts: no file matches {path}")
        return files
    raise FileNotFoundError(f"ParquetPrompts: no such file or directory: {given}")


class HFDiskDataset(DataSource):
    """One record per row of a Hugging Face dataset written by ``save_to_disk``.

    A ``DatasetDict`` needs ``split`` unless it has a single split. Rows are read as Arrow
    (no decoding of images or audio), ``batch_size`` at a time, from the memory-mapped files.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_ColumnarOptions):
        path: str
        split: str | None = None

    def __init__(self, config: HFDiskDataset.Config) -> None:
        super().__init__(config)
        if not Path(config.path).is_dir():
            raise FileNotFoundError(f"HFDiskDataset: no such directory: {config.path}")
        import datasets  # a second or more to import

        loaded = datasets.load_from_disk(config.path)
        self.where = config.path
        if isinstance(loaded, datasets.DatasetDict):
            split = _choose_split(list(loaded), config.split, config.path)
            self.where = f"{config.path} (split {split})"
            loaded = loaded[split]
        elif config.split is not None:
            raise ValueError(
                f"HFDiskDataset: {config.path} is a single Dataset, without splits; remove `split`"
            )
        _check_columns(loaded.column_names, config.columns, self.where)
        if config.columns:
            loaded = loaded.select_columns(config.columns)
        self.dataset = loaded.with_format("arrow")

    def records(self) -> Iterator[Record]:
        config = self.config
        batches = (table.to_pylist() for table in self.dataset.iter(batch_size=config.batch_size))
        yield from _render_rows([(self.where, batches)], config.template, config.limit)


def _choose_split(splits: list[str], split: str | None, path: str) -> str:
    if split is None:
        if len(splits) == 1:
            return splits[0]
        raise ValueError(f"HFDiskDataset: {path} holds the splits {splits}: set `split` to one of them")
    if split not in splits:
        raise ValueError(f"HFDiskDataset: {path} has no split {split!r} (it has {splits})")
    return split


def _check_columns(names: Sequence[str], wanted: Sequence[str], where: str) -> None:
    missing = [column for column in wanted if column not in names]
    if missing:
        raise ValueError(f"{where}: no column {missing} (it has {list(names)})")


def _render_rows(
    sources: Iterable[tuple[str, Iterable[list[dict[str, Any]]]]], template: str, limit: int
) -> Iterator[Record]:
    """Each row of each source's batches as a JSON-compatible record with its ``prompt``."""
    fields = template_fields(template)
    produced = 0
    for name, batches in sources:
        row = 0
        for batch in batches:
            for values in batch:
                where = f"{name}: row {row}"
                record = json_compatible(values, where)
                nulls = [field for field in fields if field in record and record[field] is None]
                if nulls:
                    raise ValueError(
                        f"{where}: the template needs field `{nulls[0]}`, which is null in this row"
                    )
                yield {**record, "prompt": render_template(template, record, where)}
                produced += 1
                row += 1
                if produced == limit:
                    return


def template_fields(template: str) -> list[str]:
    """The record fields ``template`` names (``{a.b}`` and ``{a[0]}`` name ``a``), in order."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    fields = [name.split(".")[0].split("[")[0] for name in names]
    return list(dict.fromkeys(fields))


def json_compatible(value: Any, where: str) -> Any:
    """``value`` as JSON values: numpy and Arrow scalars and arrays to Python numbers and lists,
    tuples to lists, map keys to strings, dates and times to ISO 8601 strings, durations to
    seconds, decimals to exact strings, UTF-8 bytes to strings. Anything else is a TypeError
    naming ``where``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(key): json_compatible(item, f"{where}, field `{key}`") for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_compatible(item, where) for item in value]
    return json_compatible(_convert_scalar(value, where), where)


def _convert_scalar(value: Any, where: str) -> Any:
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise TypeError(f"{where}: binary data that is not UTF-8 text has no JSON form") from None
    for method in ("as_py", "tolist"):  # Arrow scalars; numpy scalars and arrays
        convert = getattr(value, method, None)
        if callable(convert):
            converted = convert()
            if converted is not value and type(converted) is not type(value):
                return converted
    raise TypeError(f"{where}: a {type(value).__name__} value has no JSON form")
