"""Chat models through the binary, on the quickstart's tiny chat model: configs/chat.toml's
prompts rendered by the chat template, and configs/tool_use.toml's two-turn tool episodes
(call, tool answer, final answer), token-exact in one process and under `rollout launch`.

These check the plumbing in a few steps; they do not check learning (the shipped configs'
measured rewards are in docs/chat.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from python_plugins.quickstart import create_tiny_chat_model, write_chat_datasets
from tests.e2e.harness import REPO, launch, metrics, samples, train

LAUNCHED = ["--set", "cluster.workers=2", "--set", "cluster.trainers=1"]


@pytest.fixture(scope="module")
def chat_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's chat model and data, as `rollout init-quickstart` writes them."""
    root = tmp_path_factory.mktemp("chat")
    create_tiny_chat_model(root / "chat_model")
    write_chat_datasets(root / "data", seed=0)
    return root


def shipped(name: str, directory: Path, artifacts: Path, **run: int) -> Path:
    """configs/NAME with its paths under `artifacts`, output in directory/out."""
    text = (REPO / "configs" / name).read_text().replace('"artifacts/quickstart/', f'"{artifacts}/')
    config = tomllib.loads(text)
    text = text.replace(f'output_dir = "{config["run"]["output_dir"]}"', 'output_dir = "out"')
    for key, value in run.items():
        text = text.replace(f"{key} = {config['run'][key]}\n", f"{key} = {value}\n", 1)
    path = directory / name
    path.write_text(text)
    return path


def rewards(directory: Path) -> list[float]:
    return [line["reward_mean"] for line in metrics(directory)]


BOS, END, TOOL = 1, 2, 7  # the chat tokenizer's <s>, <|end|> and <|tool|> (python_plugins.quickstart)


def test_chat_prompts_run_through_the_binary(tmp_path: Path, chat_artifacts: Path) -> None:
    config = shipped("chat.toml", tmp_path, chat_artifacts, steps=2)
    lines = train(config, "--set", "sft.steps=2", "--set", "run.log_samples=8")
    assert len(lines) == 2
    for sample in samples(tmp_path):
        # The prompt is the chat template's, with the system prompt; one BOS, the tokenizer's.
        assert sample["prompt"].startswith("<|system|>add.<|end|>\n<|user|>")
        assert sample["prompt"].endswith("<|assistant|>")
        prompt = sample["tokens"][: sample["generated"].index(True)]
        assert prompt[:1] == [BOS] and BOS not in prompt[1:]


@pytest.mark.parametrize("launched", [False, True], ids=["run", "launch"])
def test_tool_episodes_run_in_one_process_and_launched(
    tmp_path: Path, chat_artifacts: Path, launched: bool
) -> None:
    """The Calculator environment plays its episodes through the binary, in one process and
    with the controller, workers and trainer as separate processes. A short warm start keeps
    this quick, so the model rarely calls the tool yet: the call's turn boundary is checked on
    the episodes that did (tests/python/test_chat.py checks token-exactness fully)."""
    config = shipped("tool_use.toml", tmp_path, chat_artifacts, steps=2)
    extra = ["--set", "run.log_samples=128", "--set", "sft.steps=30", "--set", "sft.batch_size=32"]
    if launched:
        launch(config, *LAUNCHED, *extra)
    else:
        train(config, *extra)
    lines = metrics(tmp_path)
    assert len(lines) == 2 and all(line["environment_failed"] == 0 for line in lines)
    logged = samples(tmp_path)
    assert logged and all(s["prompt"].startswith("<|system|>tools: calc<|end|>") for s in logged)
    checked = 0
    for sample in logged:
        tokens, generated = sample["tokens"], sample["generated"]
        first = generated.index(True)
        tool_turns = [i for i in range(first, len(tokens)) if tokens[i] == TOOL and not generated[i]]
        if tool_turns:
            turn_end = tool_turns[0] - 2  # <|end|> "\n" <|tool|>
            # One <|end|> closes the call's turn: the one it stopped on (generated), or, for a
            # turn cut at max_new_tokens, the template's (from the observation); never two.
            assert tokens[turn_end] == END and tokens[turn_end - 1] != END
            assert generated[turn_end] or generated[turn_end - 1]
            assert not generated[turn_end + 1]
            checked += 1
    assert checked, "no episode called the tool"
