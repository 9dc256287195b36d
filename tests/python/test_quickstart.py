"""The quickstart's tokenizer, tiny model and addition data."""

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from python_plugins import quickstart

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2}


def test_tiny_model_files_are_byte_identical_for_the_same_arguments(tmp_path):
    quickstart.create_tiny_model(tmp_path / "a", seed=3, **SMALL)
    quickstart.create_tiny_model(tmp_path / "b", seed=3, **SMALL)
    quickstart.create_tiny_model(tmp_path / "c", seed=4, **SMALL)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (
        tmp_path / "c" / "model.safetensors"
    ).read_bytes()


def test_tiny_model_loads_with_auto_classes(tmp_path):
    quickstart.create_tiny_model(tmp_path, intermediate_size=48, **SMALL)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.hidden_size == 32
    assert model.config.intermediate_size == 48
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_char_tokenizer_round_trip(tmp_path):
    quickstart.create_char_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer("12+34=46", add_special_tokens=False)["input_ids"]
    assert len(ids) == len("12+34=46")
    assert tokenizer.decode(ids) == "12+34=46"
    assert tokenizer.decode(
        [*ids, tokenizer.eos_token_id, tokenizer.pad_token_id], skip_special_tokens=True
    ) == ("12+34=46")
    text = "i am thinking of a number from 1 to 20.\n\nguess:  7\nhigher."
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer("?")["input_ids"] != [tokenizer.unk_token_id]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_addition_dataset(tmp_path):
    path = quickstart.write_addition_dataset(tmp_path / "add.jsonl", count=50, seed=1, digits=2)
    records = read(path)
    assert len(records) == 50
    assert len({r["question"] for r in records}) == 50
    for record in records:
        left, right = record["question"].removesuffix("=").split("+")
        assert int(record["answer"]) == int(left) + int(right)
        assert int(left) < 100 and int(right) < 100
    assert (
        path.read_bytes()
        == quickstart.write_addition_dataset(tmp_path / "again.jsonl", count=50, seed=1).read_bytes()
    )


def test_splits_are_disjoint(tmp_path):
    train, test = quickstart.write_addition_splits(tmp_path, train=300, test=100, seed=0)
    train_questions = {r["question"] for r in read(train)}
    test_questions = {r["question"] for r in read(test)}
    assert (len(train_questions), len(test_questions)) == (300, 100)
    assert not train_questions & test_questions


def test_more_problems_than_exist_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="only 100 distinct"):
        quickstart.write_addition_splits(tmp_path, train=90, test=20, seed=0, digits=1)


def test_create_is_idempotent_and_force_rewrites(tmp_path, capsys):
    written = quickstart.create(str(tmp_path), False)
    assert set(written) == {
        "model",
        "train",
        "test",
        "config",
        "parameters",
        "chat_model",
        "chat_train",
        "calc_train",
    }
    assert AutoTokenizer.from_pretrained(written["model"]) is not None
    assert AutoTokenizer.from_pretrained(written["chat_model"]).chat_template == quickstart.CHAT_TEMPLATE
    weights = tmp_path / "model" / "model.safetensors"
    train = tmp_path / "data" / "train.jsonl"
    stamps = weights.stat().st_mtime_ns, train.stat().st_mtime_ns
    assert quickstart.create(str(tmp_path), False) == written
    assert (weights.stat().st_mtime_ns, train.stat().st_mtime_ns) == stamps
    assert quickstart.main([str(tmp_path), "--force"]) == 0
    assert "model" in capsys.readouterr().out
    assert weights.stat().st_mtime_ns != stamps[0]


def test_the_written_config_is_the_repositorys_quickstart_with_paths_under_the_directory(tmp_path):
    """`rollout init-quickstart --dir D` writes D/quickstart.toml: configs/quickstart.toml, so
    that an installed rollout (no clone) runs the same quickstart."""
    written = quickstart.create(str(tmp_path), False)
    assert Path(written["model"]).is_absolute()
    repo = (Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml").read_text()
    repo = repo.replace('"artifacts/quickstart/model"', json.dumps(written["model"]))
    repo = repo.replace('"artifacts/quickstart/data/train.jsonl"', json.dumps(written["train"]))

    def settings(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]

    assert settings(Path(written["config"]).read_text()) == settings(repo)


def test_the_chat_data_is_seeded_and_has_both_halves_of_a_tool_episode(tmp_path):
    chat, calc = quickstart.write_chat_datasets(tmp_path, seed=0)
    again = quickstart.write_chat_datasets(tmp_path / "again", seed=0)
    assert (chat.read_bytes(), calc.read_bytes()) == (again[0].read_bytes(), again[1].read_bytes())
    first = json.loads(chat.read_text().splitlines()[0])
    assert first["messages"][0]["role"] == "user" and first["answer"].isdigit()
    opening, continued = (json.loads(line) for line in calc.read_text().splitlines()[:2])
    assert opening["target"].startswith("<tool_call>") and opening["messages"][-1]["role"] == "user"
    assert continued["target"] == continued["answer"] and continued["messages"][-1]["role"] == "tool"
