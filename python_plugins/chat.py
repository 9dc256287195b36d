"""Chat models: prompts from chat messages, multi-turn episodes through the chat template,
and tool calls.

- :class:`ChatTemplate` renders messages with a tokenizer's chat template: a prompt that
  starts a sequence, and the continuation that follows a policy turn (the next user or tool
  message and the generation prompt), computed as the suffix of the whole conversation.
- :class:`ChatPrompts` (a data source) and :class:`RenderChat` (a transform) turn a record's
  ``messages`` into its ``prompt``.
- :class:`ChatEnvironment` is the base of multi-turn chat environments; :func:`parse_tool_calls`
  reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` from a turn.

Token-exactness: the policy's tokens are never re-tokenised. A prompt is rendered as text and
encoded once by the policy; when the tokenizer puts a BOS in front of every text by itself
(``HFCausalLM.encode`` then adds it) and the template writes it too, the template's copy is
left out of the text, so the ids are exactly ``apply_chat_template(..., tokenize=True)``'s.
After a turn, only the template's text after the turn's content is encoded (as a
continuation); a turn that stopped on the end-of-turn token already holds it, and the
controller does not repeat it (docs/chat.md).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from python_plugins.data import jsonl_objects
from python_plugins.hub_cache import resolve_model_path
from rollout_sdk import DataSource, Environment, Record, StepResult, Transform

__all__ = [
    "ROLES",
    "ChatEnvironment",
    "ChatPrompts",
    "ChatReply",
    "ChatTemplate",
    "RenderChat",
    "ToolCall",
    "ToolCallError",
    "chat_template",
    "check_messages",
    "parse_tool_calls",
]

ROLES = ("system", "user", "assistant", "tool")
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# A turn's tool calls are refused past these sizes (a policy can write anything).
MAX_TOOL_CALLS = 4
MAX_TOOL_CALL_CHARS = 2048
# Stands for a turn's content while the text after it is found; no template rewrites it.
_SENTINEL = "\u2063ROLLOUT-TURN-CONTENT\u2063"


class ChatTemplate:
    """A tokenizer's chat template, rendered as text for the policy to encode.

    ``tokenizer`` is a model directory (or a cached hub id) with a tokenizer whose config
    holds a ``chat_template``, or a loaded tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer))
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of `{getattr(tokenizer, 'name_or_path', tokenizer)}` has no chat "
                "template (`chat_template` in tokenizer_config.json or chat_template.jinja)"
            )
        self.tokenizer = tokenizer
        bos = tokenizer.bos_token
        adds_bos = bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [
            tokenizer.bos_token_id
        ]
        # The BOS text the policy's encode adds by itself, so the rendered text must not hold it.
        self.own_bos: str | None = bos if adds_bos else None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's text, as ``apply_chat_template(..., tokenize=False)`` renders it."""
        return self.tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            tools=[dict(tool) for tool in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def prompt(
        self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """The text that starts a sequence: the conversation and the generation prompt, less
        a leading BOS the tokenizer adds by itself."""
        text = self.render(messages, tools=tools)
        if self.own_bos and text.startswith(self.own_bos):
            text = text[len(self.own_bos) :]
        return text

    def continuation(
        self,
        history: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The text after an assistant turn's content: the template's end of that turn, the
        ``new_messages`` (user or tool) and the generation prompt.

        ``history`` is the conversation before the turn. The conversation is rendered with
        and without the new messages; the rendering without them must be a prefix of the one
        with them (a template that rewrites earlier turns, such as one dropping past
        reasoning, cannot be continued token-exactly and raises ValueError).
        """
        before = self.render(history, tools=tools)
        turn = {"role": "assistant", "content": _SENTINEL}
        after = self.render([*history, turn, *new_messages], tools=tools)
        if not after.startswith(before + _SENTINEL):
            raise ValueError(
                "the chat template renders the conversation differently once it goes on (it "
                "rewrites earlier turns or the assistant's content), so a turn cannot be "
                f"appended token-exactly; rendered before: {before[-200:]!r}; after: "
                f"{after[: len(before) + 200][-400:]!r}"
            )
        return after[len(before) + len(_SENTINEL) :]


_TEMPLATES: dict[str, ChatTemplate] = {}
_TEMPLATES_LOCK = threading.Lock()


def chat_template(tokenizer: str) -> ChatTemplate:
    """The :class:`ChatTemplate` of a model directory or hub id, loaded once per process
    (environments are created per episode)."""
    with _TEMPLATES_LOCK:
        if tokenizer not in _TEMPLATES:
            _TEMPLATES[tokenizer] = ChatTemplate(tokenizer)
        return _TEMPLATES[tokenizer]


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts, or ValueError naming ``where``."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: `messages` must be a non-empty list, got {type(messages).__name__}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}: messages[{index}] must be an object with `role` and `content`")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(
                f"{where}: messages[{index}] has role {role!r}; expected one of {', '.join(ROLES)}"
            )
        if not isinstance(content, str):
            raise ValueError(f"{where}: messages[{index}] needs a string `content`")
        checked.append({**message, "role": role, "content": content})
    return checked


def with_system_prompt(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """``messages`` with ``system_prompt`` first, unless they start with a system message."""
    if system_prompt is None or (messages[:1] and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


@dataclasses.dataclass(kw_only=True, slots=True)
class _ChatOptions:
    # The model directory (or cached hub id) whose tokenizer's chat template renders prompts;
    # normally the policy's `model_path`.
    tokenizer: str
    # Put first when a record's messages do not start with a system message.
    system_prompt: str | None = None
    messages_key: str = "messages"
    # A record field with tool schemas to offer (rendered by the template) when present.
    tools_key: str = "tools"


class RenderChat(Transform):
    """Set ``record["prompt"]`` to ``record[messages_key]`` rendered by the chat template."""

    Config = _ChatOptions

    def __init__(self, config: _ChatOptions) -> None:
        super().__init__(config)
        self.template = chat_template(config.tokenizer)

    def __call__(self, record: Record) -> Record:
        return self.render(record, "RenderChat")

    def render(self, record: Record, where: str) -> Record:
        key = self.config.messages_key
        if key not in record:
            raise KeyError(f"{where}: the record has no `{key}` field")
        messages = with_system_prompt(check_messages(record[key], where), self.config.system_prompt)
        tools = record.get(self.config.tools_key) or None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
            raise ValueError(f"{where}: `{self.config.tools_key}` must be a list of tool schemas (objects)")
        return {**record, "prompt": self.template.prompt(messages, tools=tools)}


class ChatPrompts(DataSource):
    """One record per line of a JSONL file, with ``prompt`` rendered from its ``messages``
    by the tokenizer's chat template (and the generation prompt). Every field of the line is
    kept next to ``prompt``."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        path: str
        tokenizer: str
        system_prompt: str | None = None
        messages_key: str = "messages"
        tools_key: str = "tools"
        # 0 reads every line.
        limit: int = 0

        def __post_init__(self) -> None:
            if self.limit < 0:
                raise ValueError(f"limit must be 0 (all) or positive, got {self.limit}")

    def __init__(self, config: ChatPrompts.Config) -> None:
        super().__init__(config)
        self.path = Path(config.path)
        if not self.path.is_file():
            raise FileNotFoundError(f"ChatPrompts: no such file: {self.path}")
        self.renderer = RenderChat(
            RenderChat.Config(
                tokenizer=config.tokenizer,
                system_prompt=config.system_prompt,
                messages_key=config.messages_key,
                tools_key=config.tools_key,
            )
        )

    def records(self) -> Iterator[Record]:
        for record, where in jsonl_objects(self.path, self.config.limit):
            yield self.renderer.render(record, where)


# ---------------------------------------------------------------------------------------------
# Tool calls


class ToolCallError(ValueError):
    """A turn's tool call that cannot be read; the message says why (for the tool reply)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in a turn: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (the Hermes/Qwen format), in order; ``[]`` when the turn has none.

    Raises :class:`ToolCallError` for an unclosed tag, a body that is not such a JSON object,
    more than ``MAX_TOOL_CALLS`` calls or one longer than ``MAX_TOOL_CALL_CHARS``.
    """
    calls: list[ToolCall] = []
    position = 0
    while (start := text.find(TOOL_CALL_OPEN, position)) != -1:
        if len(calls) == MAX_TOOL_CALLS:
            raise ToolCallError(f"more than {MAX_TOOL_CALLS} tool calls in one turn")
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end == -1:
            raise ToolCallError(f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}")
        calls.append(_parse_tool_call(text[body_start:end]))
        position = end + len(TOOL_CALL_CLOSE)
    return calls


def _parse_tool_call(body: str) -> ToolCall:
    if len(body) > MAX_TOOL_CALL_CHARS:
        raise ToolCallError(f"a tool call longer than {MAX_TOOL_CALL_CHARS} characters")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as err:
        raise ToolCallError(f"the tool call is not valid JSON: {str(err)[:200]}") from None
    if not isinstance(value, dict):
        raise ToolCallError(f"a tool call must be a JSON object, got {type(value).__name__}")
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ToolCallError('a tool call needs a string "name"')
    if not isinstance(arguments, dict):
        raise ToolCallError('a tool call\'s "arguments" must be a JSON object')
    return ToolCall(name=name, arguments=arguments)


# ---------------------------------------------------------------------------------------------
# Environments


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatReply:
    """What a chat environment answers to one assistant turn: the messages that follow it
    (``user`` or ``tool``; ignored when ``done``), a reward and whether the episode ends."""

    messages: Sequence[Mapping[str, str]] = ()
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)


class ChatEnvironment(Environment):
    """A multi-turn environment that speaks in chat messages.

    Subclasses implement :meth:`start` (the conversation an episode opens with) and
    :meth:`reply` (the messages after an assistant turn); this class renders them through
    the chat template of ``config.tokenizer`` (its ``Config`` needs ``tokenizer``, and may
    have ``system_prompt``) and keeps the conversation. ``tools`` (JSON schemas, as
    ``apply_chat_template`` takes them) are offered to the model through the template.
    """

    tools: Sequence[Mapping[str, Any]] = ()

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.template = chat_template(config.tokenizer)
        self.messages: list[dict[str, str]] = []

    def start(self, record: Mapping[str, Any], *, seed: int) -> list[dict[str, str]]:
        """The episode's first messages (a system prompt is added by :meth:`reset`)."""
        raise NotImplementedError

    def reply(self, content: str) -> ChatReply:
        """Answer the assistant turn ``content`` (already appended to ``self.messages``)."""
        raise NotImplementedError

    def reset(self, record: Mapping[str, Any], *, seed: int) -> str:
        messages = check_messages(self.start(record, seed=seed), type(self).__name__)
        self.messages = with_system_prompt(messages, getattr(self.config, "system_prompt", None))
        return self.template.prompt(self.messages, tools=self.tools or None)

    def step(self, action: str) -> StepResult:
        history = list(self.messages)
        self.messages.append({"role": "assistant", "content": action})
        reply = self.reply(action)
        if reply.done:
            return StepResult(reward=reply.reward, done=True, info=reply.info)
        new = check_messages(list(reply.messages), f"{type(self).__name__}.reply")
        observation = self.template.continuation(history, new, tools=self.tools or None)
        self.messages.extend(new)
        return StepResult(observation=observation, reward=reply.reward, done=False, info=reply.info)
