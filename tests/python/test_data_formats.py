"""ParquetPrompts and HFDiskDataset: columnar prompt sources, read back from tmp_path."""

import datetime
import decimal
import json
import re

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from python_plugins.data_formats import json_compatible
from rollout_sdk import ConfigError
from rollout_sdk.testing import check_data_source, load_plugin

RECORDS = [
    {"question": "1+2=", "answer": "3", "id": 1, "score": 0.5, "tags": ["a", "b"], "meta": {"level": 1}},
    {"question": "10+20=", "answer": "30", "id": 2, "score": 1.5, "tags": [], "meta": {"level": 2}},
    {"question": "99+1=", "answer": "100", "id": 3, "score": -1.0, "tags": ["c"], "meta": {"level": 3}},
    {
        "question": "7+8=",
        "answer": "15",
        "id": 4,
        "score": 0.0,
        "tags": ["d", "e", "f"],
        "meta": {"level": 1},
    },
    {"question": "0+0=", "answer": "0", "id": 5, "score": 2.25, "tags": ["g"], "meta": {"level": 2}},
]


def expected(records=RECORDS, template="Q: {question}"):
    return [{**r, "prompt": template.format_map(r)} for r in records]


def write_parquet(path, records, **kwargs):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path, **kwargs)
    return path


def parquet(path, **options):
    return load_plugin("python_plugins.data_formats:ParquetPrompts", {"path": str(path), **options})


def hf(path, **options):
    return load_plugin("python_plugins.data_formats:HFDiskDataset", {"path": str(path), **options})


def test_a_parquet_file_reads_back_in_order_with_every_field(tmp_path):
    # Two-row row groups and three-row batches: records cross both boundaries.
    path = write_parquet(tmp_path / "train.parquet", RECORDS, row_group_size=2)
    records = check_data_source(parquet(path, template="Q: {question}", batch_size=3))
    assert records == expected()
    assert json.loads(json.dumps(records)) == records


def test_directory_and_glob_read_the_files_in_sorted_order(tmp_path):
    write_parquet(tmp_path / "data" / "part-1.parquet", RECORDS[3:])
    write_parquet(tmp_path / "data" / "part-0.parquet", RECORDS[:3])
    (tmp_path / "data" / "README.md").write_text("not data")
    for path in (tmp_path / "data", tmp_path / "data" / "part-*.parquet"):
        assert list(parquet(path, template="Q: {question}").records()) == expected()


def test_columns_and_limit_across_files(tmp_path):
    write_parquet(tmp_path / "data" / "a.parquet", RECORDS[:2])
    write_parquet(tmp_path / "data" / "b.parquet", RECORDS[2:])
    source = parquet(tmp_path / "data", template="{question}", columns=["question", "answer"], limit=3)
    assert list(source.records()) == [
        {"question": r["question"], "answer": r["answer"], "prompt": r["question"]} for r in RECORDS[:3]
    ]


def test_a_missing_prompt_field_names_the_file_and_row(tmp_path):
    path = write_parquet(tmp_path / "q.parquet", [{"question": "x"}])
    with pytest.raises(KeyError, match=re.escape(f"{path}: row 0: the template needs field `prompt`")):
        list(parquet(path).records())


def test_a_null_prompt_names_the_file_and_row(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": None}])
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: row 2: the template needs field `prompt`, which is null")
    ):
        list(parquet(path).records())


def test_a_missing_column_is_an_error_when_the_source_is_built(tmp_path):
    path = write_parquet(tmp_path / "q.parquet", RECORDS)
    with pytest.raises(ValueError, match=re.escape(f"{path}: no column ['context']")):
        parquet(path, template="{question}", columns=["question", "context"])


def test_missing_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file or directory: .*nowhere\.parquet"):
        parquet(tmp_path / "nowhere.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.parquet file under .*empty"):
        parquet(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"no file matches .*train-\*\.parquet"):
        parquet(tmp_path / "train-*.parquet")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"limit": -1}, "limit"),
        ({"template": "{0}"}, "template"),
        ({"columns": ["question", "question"]}, "columns"),
        ({"template": "{question} {answer}", "columns": ["question"]}, r"needs \['answer'\]"),
    ],
)
def test_bad_options_are_config_errors(tmp_path, options, message):
    path = write_parquet(tmp_path / "q.parquet", RECORDS)
    with pytest.raises(ConfigError, match=message):
        parquet(path, **options)


def test_arrow_types_become_json_values(tmp_path):
    table = pa.table(
        {
            "prompt": ["p"],
            "when": pa.array([datetime.datetime(2024, 5, 6, 7, 8, 9)], pa.timestamp("s")),
            "day": pa.array([datetime.date(2024, 5, 6)], pa.date32()),
            "price": pa.array([decimal.Decimal("1.10")], pa.decimal128(5, 2)),
            "blob": pa.array([b"text"], pa.binary()),
            "counts": pa.array([[("x", 1), ("y", 2)]], pa.map_(pa.string(), pa.int64())),
            "matrix": pa.array([[[1, 2], [3]]], pa.list_(pa.list_(pa.int32()))),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    (record,) = check_data_source(parquet(tmp_path / "t.parquet"))
    assert record == {
        "prompt": "p",
        "when": "2024-05-06T07:08:09",
        "day": "2024-05-06",
        "price": "1.10",
        "blob": "text",
        "counts": [["x", 1], ["y", 2]],
        "matrix": [[1, 2], [3]],
    }


def test_json_compatible_converts_numpy_and_rejects_the_rest():
    value = {"a": np.int64(3), "b": np.float32(0.5), "c": np.array([[1, 2], [3, 4]]), 4: (np.bool_(True),)}
    assert json_compatible(value, "here") == {"a": 3, "b": 0.5, "c": [[1, 2], [3, 4]], "4": [True]}
    assert type(json_compatible(np.int64(3), "here")) is int
    assert json_compatible(pa.scalar([1, 2]), "here") == [1, 2]
    with pytest.raises(TypeError, match=r"here, field `x`: binary data that is not UTF-8"):
        json_compatible({"x": b"\xff"}, "here")
    with pytest.raises(TypeError, match="here: a object value has no JSON form"):
        json_compatible(object(), "here")


def test_a_saved_dataset_reads_back_in_order(tmp_path):
    datasets.Dataset.from_list(RECORDS).save_to_disk(tmp_path / "ds")
    records = check_data_source(hf(tmp_path / "ds", template="Q: {question}", batch_size=2))
    assert records == expected()
    limited = hf(tmp_path / "ds", template="{question}", columns=["question", "id"], limit=2)
    assert list(limited.records()) == [
        {"question": r["question"], "id": r["id"], "prompt": r["question"]} for r in RECORDS[:2]
    ]


def test_a_dataset_dict_needs_a_split_unless_it_has_one(tmp_path):
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(RECORDS[:3]), "test": datasets.Dataset.from_list(RECORDS[3:])}
    )
    splits.save_to_disk(tmp_path / "dd")
    assert list(hf(tmp_path / "dd", split="test", template="Q: {question}").records()) == expected(
        RECORDS[3:]
    )
    with pytest.raises(ValueError, match=r"holds the splits \['train', 'test'\]: set `split`"):
        hf(tmp_path / "dd")
    with pytest.raises(ValueError, match=r"has no split 'validation'"):
        hf(tmp_path / "dd", split="validation")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}).save_to_disk(tmp_path / "one")
    assert list(hf(tmp_path / "one", template="Q: {question}").records()) == expected()
    datasets.Dataset.from_list(RECORDS).save_to_disk(tmp_path / "single")
    with pytest.raises(ValueError, match="single Dataset, without splits"):
        hf(tmp_path / "single", split="train")


def test_hf_errors_name_the_dataset_split_and_row(tmp_path):
    rows = [{"prompt": "a", "x": 1}, {"prompt": None, "x": 2}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "dd")
    with pytest.raises(
        ValueError, match=re.escape(f"{tmp_path / 'dd'} (split train): row 1: the template needs")
    ):
        list(hf(tmp_path / "dd").records())
    with pytest.raises(
        KeyError, match=re.escape("(split train): row 0: the template needs field `question`")
    ):
        list(hf(tmp_path / "dd", template="{question}").records())
    with pytest.raises(ValueError, match=re.escape("no column ['question']")):
        hf(tmp_path / "dd", template="{question}", columns=["question"])
    with pytest.raises(FileNotFoundError, match="no such directory"):
        hf(tmp_path / "missing")
