"""End to end: a run reading its prompts from Parquet or a saved Hugging Face dataset trains on
the same prompts, in the same order, as the same records read from JSONL."""

from __future__ import annotations

from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.e2e.harness import read_jsonl, run, samples, write_config

SOURCES = {
    "parquet": "python_plugins.data_formats:ParquetPrompts",
    "hf": "python_plugins.data_formats:HFDiskDataset",
}


def step_prompts(directory: Path) -> dict[int, list[str]]:
    """Each step's prompts, in the order samples.jsonl has them."""
    prompts: dict[int, list[str]] = {}
    for sample in samples(directory):
        prompts.setdefault(sample["step"], []).append(sample["prompt"])
    return prompts


def converted(artifacts: Path, tmp_path: Path) -> dict[str, Path]:
    """The tiny addition data's train split as a Parquet file and as a saved dataset."""
    rows = read_jsonl(artifacts / "data" / "train.jsonl")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet", row_group_size=10)
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:4])}
    )
    splits.save_to_disk(tmp_path / "hf")
    return {"parquet": tmp_path / "train.parquet", "hf": tmp_path / "hf"}


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_columnar_sources_give_the_jsonl_runs_prompts(tmp_path: Path, artifacts: Path, kind: str) -> None:
    paths = converted(artifacts, tmp_path)
    common = ("--set", "run.steps=2", "--set", "run.log_samples=8", "--set", "sft.steps=0")
    jsonl_dir = tmp_path / "run-jsonl"
    jsonl_dir.mkdir()
    run(write_config(jsonl_dir, artifacts, steps=2), *common)
    other_dir = tmp_path / f"run-{kind}"
    other_dir.mkdir()
    overrides = ["--set", f"data.plugin={SOURCES[kind]}", "--set", f"data.options.path={paths[kind]}"]
    if kind == "hf":
        overrides += ["--set", "data.options.split=train"]
    result = run(write_config(other_dir, artifacts, steps=2), *common, *overrides)
    expected = step_prompts(jsonl_dir)
    assert sorted(expected) == [1, 2]
    assert step_prompts(other_dir) == expected, result.stderr[-2000:]
