"""JsonlPrompts and the Template / DropLongPrompts transforms."""

import json
import re

import pytest

from rollout_sdk import ConfigError, Pipeline
from rollout_sdk.testing import check_data_source, load_plugin

RECORDS = [
    {"question": "1+2=", "answer": "3"},
    {"question": "10+20=", "answer": "30"},
    {"question": "what is 99 plus 1? answer: ", "answer": "100"},
]


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def source(path, **options):
    return load_plugin("python_plugins.data:JsonlPrompts", {"path": str(path), **options})


def test_check_data_source_with_a_template(data_file):
    records = check_data_source(source(data_file, template="Q: {question}"))
    assert records == [{**r, "prompt": "Q: " + r["question"]} for r in RECORDS]


def test_default_template_reads_the_prompt_field(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello", "id": 1}\n\n{"prompt": "bye", "id": 2}\n')
    assert list(source(path).records()) == [{"prompt": "hello", "id": 1}, {"prompt": "bye", "id": 2}]


def test_limit(data_file):
    assert [r["answer"] for r in source(data_file, template="{question}", limit=2).records()] == ["3", "30"]
    assert len(list(source(data_file, template="{question}", limit=0).records())) == 3


def test_invalid_json_names_path_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: invalid JSON")):
        list(source(path).records())


def test_non_object_line_is_rejected(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: expected a JSON object")):
        list(source(path).records())


def test_template_with_a_missing_field_names_it_and_the_line(data_file):
    with pytest.raises(KeyError, match=re.escape(f"{data_file}:1: the template needs field `context`")):
        list(source(data_file, template="{context} {question}").records())


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nowhere\.jsonl"):
        source(missing)


@pytest.mark.parametrize("template", ["{", "{} and {}", "{0}"])
def test_bad_templates_are_config_errors(data_file, template):
    with pytest.raises(ConfigError, match="template"):
        source(data_file, template=template)


def test_transforms_compose_in_a_pipeline(data_file):
    transforms = [
        load_plugin("python_plugins.data:Template", {"template": "Question: {question}"}),
        load_plugin("python_plugins.data:DropLongPrompts", {"max_chars": 20}),
        load_plugin("python_plugins.data:Template", {"template": "{prompt} ({answer})", "target": "shown"}),
    ]
    records = check_data_source(source(data_file, template="{question}"), transforms)
    assert [r["prompt"] for r in records] == ["Question: 1+2=", "Question: 10+20="]
    assert [r["shown"] for r in records] == ["Question: 1+2= (3)", "Question: 10+20= (30)"]


def test_template_transform_reports_the_missing_field():
    template = load_plugin("python_plugins.data:Template", {"template": "{missing}"})
    with pytest.raises(KeyError, match="needs field `missing`"):
        template({"prompt": "x"})


def test_drop_long_prompts_keeps_the_boundary():
    drop = load_plugin("python_plugins.data:DropLongPrompts", {"max_chars": 3})
    out = list(Pipeline([drop])([{"prompt": "abc"}, {"prompt": "abcd"}, {"prompt": ""}]))
    assert out == [{"prompt": "abc"}, {"prompt": ""}]
    with pytest.raises(ConfigError, match="max_chars"):
        load_plugin("python_plugins.data:DropLongPrompts", {"max_chars": 0})
