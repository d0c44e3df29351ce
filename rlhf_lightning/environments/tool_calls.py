"""Tool calls in generated text, in the format of the base's chat template.

Two formats cover most open models: ChatML/Hermes (Qwen 2/2.5/3, Hermes, many fine-tunes) writes each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; Llama 3.1/3.2 write one bare JSON object
``{"name": ..., "parameters": {...}}`` as the whole turn. The format is read from what the template renders for an
assistant message with a tool call, so a template we cannot parse stops the run at setup, naming itself, rather
than training an agent whose calls are never run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_PROBE_ARGUMENTS = {"probe_argument": 7}


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: ``name`` and ``arguments``, or ``error`` when it cannot be read."""

    name: str | None
    arguments: Any = None
    error: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The call in the ``tool_calls`` shape chat templates render."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its text and its calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


def _read_call(text: str, arguments_key: str) -> ToolCall:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return ToolCall(None, error=f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(None, error='the tool call must be a JSON object with a string "name"')
    return ToolCall(value["name"], value.get(arguments_key, {}))


class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, any number per turn (ChatML/Qwen)."""

    name = "hermes"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> ParsedTurn:
        calls = [_read_call(body, "arguments") for body in self._CALL.findall(text)]
        content = text.split("<tool_call>", 1)[0].strip()
        return ParsedTurn(content, calls)


class Llama3JsonFormat:
    """A turn that is one JSON object ``{"name": ..., "parameters": ...}`` (Llama 3.1/3.2's JSON tool calling;
    ``<|python_tag|>`` in front is accepted). A turn that does not start with ``{`` is plain content."""

    name = "llama3_json"

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedTurn(text.strip())
        return ParsedTurn("", [_read_call(body, "parameters")])


FORMATS = {"hermes": HermesFormat, "llama3_json": Llama3JsonFormat}


def template_name(tokenizer: Any) -> str:
    """How a message names the template: the tokenizer's folder, else the template's first characters."""
    where = getattr(tokenizer, "name_or_path", "") or ""
    template = (tokenizer.chat_template or "").replace("\n", " ")
    return f"the chat template of {where!r}" if where else f"the chat template {template[:60]!r}..."


def detect_format(tokenizer: Any) -> HermesFormat | Llama3JsonFormat:
    """The tool-call format of ``tokenizer``'s chat template, or a one-line error naming the template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tools need a chat template, and the tokenizer has none")
    messages = [{"role": "user", "content": "probe"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function",
                                 "function": {"name": "probe_tool", "arguments": _PROBE_ARGUMENTS}}]},
                {"role": "tool", "name": "probe_tool", "content": "probe_result"}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as error:
        raise ValueError(f"{template_name(tokenizer)} cannot render a tool call ({error})") from None
    known = ('ChatML/Hermes <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen) or Llama-3 JSON '
             '{"name": ..., "parameters": ...}')
    if "probe_tool" not in rendered or "probe_result" not in rendered:
        raise ValueError(f"{template_name(tokenizer)} drops assistant tool calls or tool messages, so an episode "
                         f"could not show the model its calls or their results; use a template that renders "
                         f"them: {known}")
    if "<tool_call>" in rendered:
        return HermesFormat()
    if '"parameters"' in rendered:
        return Llama3JsonFormat()
    raise ValueError(f"{template_name(tokenizer)} writes tool calls in a format this framework does not parse; "
                     f"known: {known}")
