"""Chat templates: prompts, BOS handling, token-exact multi-turn appends, tool calls, the
Calculator environment and hub ids resolved in the local cache."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from python_plugins.chat import (
    MAX_TOOL_CALL_CHARS,
    ChatTemplate,
    ToolCall,
    ToolCallError,
    parse_tool_calls,
)
from python_plugins.hub_cache import HubCacheMiss, is_hub_id, resolve_model_path
from python_plugins.quickstart import (
    CHAT_TEMPLATE,
    calc_records,
    create_char_tokenizer,
    create_tiny_chat_model,
)
from python_plugins.tool_use import CALC_TOOL, CalcError, Calculator, evaluate_arithmetic
from rollout_sdk.testing import load_plugin
from tests.python.policy_helpers import make_policy

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_positions": 256}


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("chat_model")
    create_tiny_chat_model(directory, **SMALL)
    return directory


@pytest.fixture(scope="module")
def policy(chat_model_dir: Path):
    return make_policy(chat_model_dir)


def template_ids(tokenizer, messages, tools=None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def append_turn(context: list[int], turn: list[int], observation: list[int], eos: list[int]) -> list[int]:
    """What the controller appends after a turn (crates/rollout-core/src/train/sampler.rs):
    the generated ids as generated, then the observation's ids, less a leading end-of-turn
    token the turn already stopped on."""
    stopped = bool(turn) and turn[-1] in eos
    if stopped and observation[:1] == turn[-1:]:
        observation = observation[1:]
    return [*context, *turn, *observation]


# ---------------------------------------------------------------------------------------------
# Prompts and BOS


def test_a_rendered_prompt_encodes_to_exactly_the_templates_ids(chat_model_dir: Path, policy) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    # The tokenizer adds its BOS by itself and the template writes it too: one BOS in all.
    assert tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False).startswith(
        "<s>"
    )
    template = ChatTemplate(str(chat_model_dir))
    for messages, tools in [
        ([{"role": "user", "content": "12+34="}], None),
        ([{"role": "system", "content": "add."}, {"role": "user", "content": "1+2="}], None),
        (calc_records(2, seed=0)[1]["messages"], [CALC_TOOL]),
    ]:
        (ids,) = policy.encode([template.prompt(messages, tools=tools)])
        assert ids == template_ids(tokenizer, messages, tools)
        assert ids.count(tokenizer.bos_token_id) == 1


def test_a_tokenizer_without_its_own_bos_keeps_the_templates(tmp_path: Path) -> None:
    create_char_tokenizer(tmp_path)  # BOS is `<eos>`, never added by the tokenizer
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m.content }};{% endfor %}"
    template = ChatTemplate(tokenizer)
    assert template.own_bos is None
    text = template.prompt([{"role": "user", "content": "7+8="}])
    assert text == "<eos>7+8=;"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == template_ids(
        tokenizer, [{"role": "user", "content": "7+8="}]
    )


def test_a_tokenizer_without_a_template_is_refused(tmp_path: Path) -> None:
    create_char_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate(str(tmp_path))


def test_chat_prompts_render_messages_with_the_system_prompt_and_tools(
    tmp_path: Path, chat_model_dir
) -> None:
    lines = [
        {"messages": [{"role": "user", "content": "1+2="}], "answer": "3"},
        {
            "messages": [{"role": "system", "content": "own."}, {"role": "user", "content": "2+2="}],
            "answer": "4",
        },
        {"messages": [{"role": "user", "content": "3*4?"}], "tools": [CALC_TOOL], "answer": "12"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    source = load_plugin(
        "python_plugins.chat:ChatPrompts",
        {"path": str(path), "tokenizer": str(chat_model_dir), "system_prompt": "add."},
    )
    prompts = [record["prompt"] for record in source.records()]
    assert prompts == [
        "<|system|>add.<|end|>\n<|user|>1+2=<|end|>\n<|assistant|>",
        "<|system|>own.<|end|>\n<|user|>2+2=<|end|>\n<|assistant|>",
        "<|system|>tools: calc<|end|>\n<|system|>add.<|end|>\n<|user|>3*4?<|end|>\n<|assistant|>",
    ]
    assert [record["answer"] for record in source.records()] == ["3", "4", "12"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"messages": []}', "non-empty list"),
        ('{"messages": "hi"}', "non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "string `content`"),
        ('{"question": "1+2="}', "no `messages`"),
        ('{"messages": [{"role": "user", "content": "x"}], "tools": "calc"}', "list of tool schemas"),
    ],
)
def test_bad_messages_name_the_line(tmp_path: Path, chat_model_dir, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n' + line + "\n")
    source = load_plugin(
        "python_plugins.chat:ChatPrompts", {"path": str(path), "tokenizer": str(chat_model_dir)}
    )
    with pytest.raises((ValueError, KeyError), match=message) as raised:
        list(source.records())
    assert f"{path}:2" in str(raised.value)


# ---------------------------------------------------------------------------------------------
# Multi-turn: token-exact appends through the template


def play(env: Calculator, policy, record, turns: list[str], *, stop: list[bool]):
    """Plays ``turns`` as the controller does; returns the context ids and the step results."""
    eos = policy.eos_token_ids()
    context = policy.encode([env.reset(record, seed=0)])[0]
    results = []
    for text, stopped in zip(turns, stop, strict=True):
        generated = policy.encode([text], continuation=True)[0] + (eos[:1] if stopped else [])
        result = env.step(policy.decode([generated])[0])
        results.append(result)
        observation = [] if result.done else policy.encode([result.observation], continuation=True)[0]
        context = append_turn(context, generated, observation, eos)
    return context, results


def test_tool_turns_append_exactly_the_templates_ids(chat_model_dir: Path, policy) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    env = load_plugin("python_plugins.tool_use:Calculator", {"tokenizer": str(chat_model_dir)})
    record = calc_records(1, seed=3)[0]
    call = record["target"]
    # A turn that stopped on its end-of-turn token, then one cut by max_new_tokens.
    for stop in ([True, True], [False, True]):
        context, results = play(env, policy, record, [call, record["answer"]], stop=stop)
        assert [r.done for r in results] == [False, True] and results[-1].reward == 1.0
        expected = template_ids(
            tokenizer,
            [
                *record["messages"],
                {"role": "assistant", "content": call},
                {"role": "tool", "content": record["answer"]},
            ],
            [CALC_TOOL],
        )
        # The whole conversation up to the final answer is the template's, token for token.
        answer = policy.encode([record["answer"]], continuation=True)[0] + policy.eos_token_ids()[:1]
        assert context == [*expected, *answer]
        assert results[0].observation.startswith("<|end|>\n<|tool|>")


def test_guess_and_check_turns_stay_exact_over_several_tool_turns(chat_model_dir: Path, policy) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    env = load_plugin(
        "python_plugins.tool_use:Calculator", {"tokenizer": str(chat_model_dir), "max_tool_turns": 3}
    )
    record = {"messages": [{"role": "user", "content": "2*3?"}], "answer": "6"}
    turns = [
        '<tool_call>{"name":"calc","arguments":{"expr":"2*"}}</tool_call>',
        '<tool_call>{"name":"calc","arguments":{"expr":"2*3"}}</tool_call>',
    ]
    context, results = play(env, policy, record, turns, stop=[True, True])
    assert [r.done for r in results] == [False, False]
    messages = [
        *record["messages"],
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": "error: cannot parse '2*' as arithmetic"},
        {"role": "assistant", "content": turns[1]},
        {"role": "tool", "content": "6"},
    ]
    assert env.messages == messages
    assert context == template_ids(tokenizer, messages, [CALC_TOOL])


def test_a_template_that_rewrites_past_turns_is_refused(chat_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    # Drops every assistant turn but the last, as reasoning templates drop past thoughts.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "{{ m.role }}:{{ m.content }};{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    template = ChatTemplate(tokenizer)
    history = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="token-exactly"):
        template.continuation(history, [{"role": "user", "content": "again"}])


# ---------------------------------------------------------------------------------------------
# Tool calls and the calculator


def test_tool_calls_are_parsed_in_order() -> None:
    text = (
        'a<tool_call>{"name": "calc", "arguments": {"expr": "1+2"}}</tool_call>'
        'b<tool_call>{"name":"x"}</tool_call>'
    )
    assert parse_tool_calls(text) == [ToolCall("calc", {"expr": "1+2"}), ToolCall("x", {})]
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<tool_call>{", "without </tool_call>"),
        ("<tool_call>{nope}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
        ('<tool_call>{"name": 3}</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', '"arguments" must be'),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "longer than"),
        ("<tool_call>" + "[" * (MAX_TOOL_CALL_CHARS - 1) + "</tool_call>", "not valid JSON"),
        ('<tool_call>{"name":"calc"}</tool_call>' * 5, "more than 4"),
    ],
)
def test_malformed_tool_calls_are_clear_errors(text: str, message: str) -> None:
    with pytest.raises(ToolCallError, match=message):
        parse_tool_calls(text)


def test_arithmetic_is_parsed_not_evaluated() -> None:
    assert evaluate_arithmetic("37*48") == 1776
    assert evaluate_arithmetic(" (1 + 2) * -3 / 2 ") == -4.5
    assert evaluate_arithmetic("2**10 // 3 % 7") == 341 % 7
    assert evaluate_arithmetic("(" * 99 + "1" + ")" * 99) == evaluate_arithmetic("-" * 198 + "1") == 1
    for hostile, message in [
        ("__import__('os').system('true')", "not Call"),
        ("open('/etc/passwd')", "not Call"),
        ("x + 1", "not Name"),
        ("(1).__class__", "not Attribute"),
        ("[1] * 10**9", "not List"),
        ("'a' * 9", "not Constant"),
        ("9**9**9", "exponents are limited"),
        ("10**30 * 10**30", "too large"),
        ("1/0", "division by zero"),
        ("1e400", "not finite"),
        ("1e29 * 100", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "cannot parse"),
        ("1" * 500, "longer than"),
        ("lambda: 1", "not Lambda"),
    ]:
        with pytest.raises(CalcError, match=message):
            evaluate_arithmetic(hostile)
    with pytest.raises(CalcError, match="must be a string"):
        evaluate_arithmetic({"expr": 1})  # type: ignore[arg-type]


def calc_step(env: Calculator, record, *actions: str):
    env.reset(record, seed=0)
    return [env.step(action) for action in actions]


def test_the_calculator_scores_the_final_answer_against_the_ground_truth(chat_model_dir: Path) -> None:
    env = load_plugin("python_plugins.tool_use:Calculator", {"tokenizer": str(chat_model_dir)})
    record = {"messages": [{"role": "user", "content": "37*48?"}], "answer": "1776"}
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "37*48"}}</tool_call>'
    assert [r.reward for r in calc_step(env, record, call, "1776")] == [0.0, 1.0]
    assert [r.reward for r in calc_step(env, record, call, "1777")] == [0.0, 0.0]
    # The tool is required: a right answer without it scores nothing (require_tool = true).
    assert [r.reward for r in calc_step(env, record, "1776")] == [0.0]
    free = load_plugin(
        "python_plugins.tool_use:Calculator", {"tokenizer": str(chat_model_dir), "require_tool": False}
    )
    assert [r.reward for r in calc_step(free, record, "1776")] == [1.0]
    # A tool result the model steered elsewhere does not change the ground truth.
    wrong = '<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call>'
    assert [r.reward for r in calc_step(env, record, wrong, "2")] == [0.0, 0.0]
    # A conversation that already holds the call and its result: the next turn answers.
    continued = calc_records(2, seed=0)[1]
    assert [r.reward for r in calc_step(env, continued, continued["answer"])] == [1.0]


def test_hostile_turns_get_error_replies_or_zero_never_a_crash(chat_model_dir: Path) -> None:
    env = load_plugin(
        "python_plugins.tool_use:Calculator", {"tokenizer": str(chat_model_dir), "max_tool_turns": 50}
    )
    record = {"messages": [{"role": "user", "content": "2*3?"}], "answer": "6"}
    env.reset(record, seed=0)
    replies = [
        ('<tool_call>{"name": "shell", "arguments": {"cmd": "rm -rf /"}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "calc", "arguments": {"expr": "__import__(\'os\')"}}</tool_call>', "not Call"),
        ('<tool_call>{"name": "calc", "arguments": {"expr": ["1"]}}</tool_call>', "must be a string"),
        ('<tool_call>{"name": "calc"}</tool_call>', "must be a string"),
        ("<tool_call>{oops", "without </tool_call>"),
        ("<tool_call>" + "{" * 5000 + "</tool_call>", "longer than"),
    ]
    for action, message in replies:
        result = env.step(action)
        assert not result.done and result.reward == 0.0
        assert message in env.messages[-1]["content"], (action, env.messages[-1])
        assert env.messages[-1]["role"] == "tool"
    rng = random.Random(0)
    for _ in range(30):
        env.reset(record, seed=0)
        noise = "".join(
            rng.choice('<>{}"/:,tool_call[] 0123456789nameexpr') for _ in range(rng.randint(0, 300))
        )
        result = env.step(noise)
        assert result.reward == 0.0
    # Out of tool turns: the episode ends unanswered.
    capped = load_plugin(
        "python_plugins.tool_use:Calculator", {"tokenizer": str(chat_model_dir), "max_tool_turns": 1}
    )
    call = '<tool_call>{"name":"calc","arguments":{"expr":"2*3"}}</tool_call>'
    results = calc_step(capped, record, call, call)
    assert [(r.done, r.reward) for r in results] == [(False, 0.0), (True, 0.0)]


# ---------------------------------------------------------------------------------------------
# Hub ids in the local cache


def cache_model(hub: Path, repo: str, source: Path, commit: str = "0123456789abcdef") -> Path:
    model = hub / f"models--{repo.replace('/', '--')}"
    snapshot = model / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_ids_resolve_in_the_local_cache_offline(
    tmp_path: Path, chat_model_dir: Path, monkeypatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    hub = tmp_path / "home" / ".cache" / "huggingface" / "hub"
    snapshot = cache_model(hub, "tiny-org/tiny-chat", chat_model_dir)
    assert resolve_model_path("tiny-org/tiny-chat") == str(snapshot)
    assert resolve_model_path("tiny-org/tiny-chat@0123456789abcdef") == str(snapshot)
    # HF_HOME and HF_HUB_CACHE move the cache.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    moved = cache_model(tmp_path / "hf" / "hub", "tiny-org/tiny-chat", chat_model_dir, commit="beef")
    assert resolve_model_path("tiny-org/tiny-chat") == str(moved)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert resolve_model_path("tiny-org/tiny-chat") == str(snapshot)
    # Paths stay paths; a missing hub id names the cache and how to fill it.
    assert resolve_model_path(str(chat_model_dir)) == str(chat_model_dir)
    assert resolve_model_path("./relative/missing") == "./relative/missing"
    with pytest.raises(HubCacheMiss, match=r"hf download tiny-org/absent"):
        resolve_model_path("tiny-org/absent")
    with pytest.raises(HubCacheMiss):
        resolve_model_path("tiny-org/tiny-chat@..")
    assert not is_hub_id("../x") and not is_hub_id("/abs/x") and not is_hub_id("a/b/c")
    # The policy and the chat template load a hub id.
    policy = make_policy("tiny-org/tiny-chat")
    assert policy.config.model_path == str(snapshot)
    assert ChatTemplate("tiny-org/tiny-chat").render([{"role": "user", "content": "x"}]) == (
        "<s><|user|>x<|end|>\n<|assistant|>"
    )


def test_the_chat_template_is_the_quickstarts(chat_model_dir: Path) -> None:
    assert AutoTokenizer.from_pretrained(chat_model_dir).chat_template == CHAT_TEMPLATE
