"""What a judge reads: a prompt template filled in with the policy's prompt, its response and the row's columns."""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

BUILT_IN_FIELDS = ("prompt", "response")
Messages = list[dict[str, str]]


def prompt_text(prompt: Any) -> str:
    """The text ``{prompt}`` stands for: a text prompt as it is, a conversation's last user message."""
    if isinstance(prompt, list):
        users = [message.get("content", "") for message in prompt if message.get("role") == "user"]
        return str(users[-1]) if users else ""
    return str(prompt)


def _fields(text: str, where: str) -> list[str]:
    """The named fields of the format string ``text``; one line naming ``where`` for anything else."""
    where = f" {where}" if where else ""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as error:
        raise ValueError(f"JudgeReward template{where}: {error} (write a literal brace as {{{{ or }}}})") from None
    names = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(f"JudgeReward template{where}: field {{{name}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}} is not a plain name; write {{prompt}}, {{response}} or "
                             "{column} (a literal brace as {{ or }})")
        names.append(name)
    return names


class JudgeTemplate:
    """A judge prompt: a Python format string, or a chat (a list of ``{role, content}`` messages whose contents are
    format strings), with the fields ``{prompt}``, ``{response}`` and any column of the prompt data.

    Args:
        template: the format string, or the messages.
    """

    def __init__(self, template: str | Messages) -> None:
        if isinstance(template, str):
            self.fields = _fields(template, "")
        elif isinstance(template, list) and template:
            self.fields = []
            for index, message in enumerate(template):
                if not isinstance(message, dict) or set(message) != {"role", "content"} \
                        or not all(isinstance(value, str) for value in message.values()):
                    raise ValueError(f"JudgeReward template message {index}: expected {{role: ..., content: ...}} "
                                     f"(two strings), got {message!r}")
                self.fields += _fields(message["content"], f"message {index}")
        else:
            raise ValueError(f"JudgeReward template: expected a format string or a non-empty list of messages, got "
                             f"{template!r}")
        if "response" not in self.fields:
            raise ValueError(f"JudgeReward template: it never names {{response}}, so the judge would never see the "
                             f"responses it scores; put {{response}} where the response goes (got {template!r})")
        self.template = template
        self.columns = [name for name in dict.fromkeys(self.fields) if name not in BUILT_IN_FIELDS]

    def check_columns(self, columns: Sequence[str]) -> None:
        """Every field besides ``prompt`` and ``response`` must be a column of the prompt data."""
        missing = [name for name in self.columns if name not in columns]
        if missing:
            raise ValueError(f"JudgeReward template: field {{{missing[0]}}} is not a column of the prompt data (its "
                             f"columns: {', '.join(columns) or 'only prompt'}); a template may name {{prompt}}, "
                             "{response} and the data's columns")

    def render(self, prompt: Any, response: str, columns: dict[str, Any]) -> str | Messages:
        """The judge's prompt for one response: text, or messages."""
        values = {**{name: columns[name] for name in self.columns}, "prompt": prompt_text(prompt),
                  "response": response}
        if isinstance(self.template, str):
            return self.template.format(**values)
        return [{"role": message["role"], "content": message["content"].format(**values)}
                for message in self.template]
