"""Turn raw :class:`~rlhf_lightning.data.sources.Record` rows into typed examples for each training stage.

Text is either a plain string or a conversation: a list of ``{"role": ..., "content": ...}`` messages.
Every parser raises :class:`~rlhf_lightning.data.sources.DataFormatError` with a message that starts with
the record's location and says which column was wrong, what was expected and what was found.

A column whose value is null counts as absent: Arrow-backed sources (Parquet, ``datasets``) fill columns
missing from some rows with nulls, and such rows should parse exactly as they would from JSON lines.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from rlhf_lightning.data.format_errors import (
    _PREVIEW_CHARS,
    _error,
    _found,
    _missing_columns,
    _present,
    _preview,
)
from rlhf_lightning.data.sources import Record

Message = dict[str, Any]  # role and content (and tool_calls, name where a template renders them)
Text = str | list[Message]

_ROLES = ("system", "user", "assistant", "tool")
_PREFERENCE_FORMS = (
    "prompt+chosen+rejected, or chosen+rejected (each a full transcript whose shared start is the prompt)"
)
_SFT_FORMS = "prompt+completion, messages, or text"
_PROMPT_FORMS = "prompt"
_STEPWISE_FORMS = "prompt+completions+labels (TRL's stepwise form: a list of step strings and one bool per step)"
_UNPAIRED_FORMS = f"prompt+completion+label (TRL's unpaired form), or a preference pair ({_PREFERENCE_FORMS})"


@dataclass(frozen=True)
class PreferenceExample:
    """A prompt with a preferred (``chosen``) and a dispreferred (``rejected``) response.

    ``margin`` is an optional preference strength; ``gold_chosen`` / ``gold_rejected`` are the true scores
    of the two responses when the data comes from a synthetic task with a known reward.
    """

    prompt: Text
    chosen: Text
    rejected: Text
    margin: float = 0.0
    gold_chosen: float | None = None
    gold_rejected: float | None = None


@dataclass(frozen=True)
class SFTExample:
    """A prompt and the completion to imitate; the loss covers only the completion."""

    prompt: Text
    completion: Text


@dataclass(frozen=True)
class UnpairedExample:
    """A prompt and one response labelled desirable or not (KTO's data); ``gold`` is the response's true score
    when the data comes from a synthetic task."""

    prompt: Text
    completion: Text
    desirable: bool
    gold: float | None = None


@dataclass(frozen=True)
class PromptExample:
    """A prompt for the policy to answer (PPO rollouts, evaluation)."""

    prompt: Text


@dataclass(frozen=True)
class StepwiseExample:
    """A prompt and a worked response as its steps, each labelled right (True) or wrong (a process reward model's
    data, TRL's stepwise form)."""

    prompt: Text
    steps: list[str]
    labels: list[bool]


def is_conversational(text: Text) -> bool:
    """Whether ``text`` is a list of chat messages rather than a plain string."""
    return isinstance(text, list)


def parse_preference(record: Record) -> PreferenceExample:
    """Parse a preference pair from ``prompt``+``chosen``+``rejected`` or HH-style ``chosen``+``rejected``.

    In the HH-style form each column holds the full transcript and the prompt is their shared start: for
    strings, backed off to a whitespace so that neither response starts mid-word (the responses keep their
    leading whitespace); for conversations, the shared leading messages.
    """
    fields = _present(record)
    if {"chosen", "rejected"} <= fields.keys() and "prompt" in record.fields and "prompt" not in fields:
        # A null in a prompt column is a hole in the data, not the transcript form (which has no prompt column).
        raise _error(record, "column 'prompt' is null; give the row a prompt (text or messages), or drop the "
                             "column to give every row as chosen/rejected transcripts")
    if {"prompt", "chosen", "rejected"} <= fields.keys():
        prompt = _text(record, "prompt", fields["prompt"])
        chosen = _text(record, "chosen", fields["chosen"])
        rejected = _text(record, "rejected", fields["rejected"])
        _check_same_kind(record, prompt=prompt, chosen=chosen, rejected=rejected)
        _check_distinct(record, chosen, rejected)
        if is_conversational(prompt):
            _check_ends_with_assistant(record, "chosen", chosen)
            _check_ends_with_assistant(record, "rejected", rejected)
    elif {"chosen", "rejected"} <= fields.keys():
        chosen = _text(record, "chosen", fields["chosen"])
        rejected = _text(record, "rejected", fields["rejected"])
        _check_same_kind(record, chosen=chosen, rejected=rejected)
        _check_distinct(record, chosen, rejected)
        if is_conversational(chosen):
            prompt, chosen, rejected = _split_shared_messages(record, chosen, rejected)
        else:
            prompt, chosen, rejected = _split_shared_text(record, chosen, rejected)
    else:
        raise _missing_columns(record, _PREFERENCE_FORMS)
    return PreferenceExample(
        prompt=prompt,
        chosen=chosen,
        rejected=rejected,
        margin=_optional_number(record, "margin", default=0.0),
        gold_chosen=_optional_number(record, "gold_chosen"),
        gold_rejected=_optional_number(record, "gold_rejected"),
    )


def parse_sft(record: Record) -> SFTExample:
    """Parse a supervised example from ``prompt``+``completion``, ``messages`` or ``text``.

    ``messages`` trains on the last message, which must be the assistant's; ``text`` has an empty prompt,
    so the loss covers every token.
    """
    fields = _present(record)
    if {"prompt", "completion"} <= fields.keys():
        prompt = _text(record, "prompt", fields["prompt"])
        completion = _text(record, "completion", fields["completion"])
        _check_same_kind(record, prompt=prompt, completion=completion)
        if is_conversational(completion):
            _check_ends_with_assistant(record, "completion", completion)
        return SFTExample(prompt=prompt, completion=completion)
    if "messages" in fields:
        messages = _messages(record, "messages", fields["messages"])
        _check_ends_with_assistant(record, "messages", messages)
        return SFTExample(prompt=messages[:-1], completion=messages[-1:])
    if "text" in fields:
        return SFTExample(prompt="", completion=_string(record, "text", fields["text"]))
    raise _missing_columns(record, _SFT_FORMS)


def parse_unpaired(record: Record) -> list[UnpairedExample]:
    """Parse labelled responses: one from ``prompt``+``completion``+``label`` (a bool, TRL's KTO columns; an
    optional ``gold`` score), or two from a preference pair in any of :func:`parse_preference`'s forms, the chosen
    response desirable and the rejected one not (TRL's ``unpair_preference_dataset``)."""
    fields = _present(record)
    if "label" in fields or ("completion" in fields and "chosen" not in fields):
        if not {"prompt", "completion", "label"} <= fields.keys():
            raise _missing_columns(record, _UNPAIRED_FORMS)
        label = fields["label"]
        if not isinstance(label, bool) and label not in (0, 1):
            raise _error(record, f"column 'label': expected true (desirable) or false (undesirable), "
                                 f"found {_found(label)}")
        prompt = _text(record, "prompt", fields["prompt"])
        completion = _text(record, "completion", fields["completion"])
        _check_same_kind(record, prompt=prompt, completion=completion)
        if is_conversational(completion):
            _check_ends_with_assistant(record, "completion", completion)
        return [UnpairedExample(prompt, completion, bool(label), _optional_number(record, "gold"))]
    if not {"chosen", "rejected"} <= fields.keys():
        raise _missing_columns(record, _UNPAIRED_FORMS)
    pair = parse_preference(record)
    return [UnpairedExample(pair.prompt, pair.chosen, True, pair.gold_chosen),
            UnpairedExample(pair.prompt, pair.rejected, False, pair.gold_rejected)]


def parse_prompt(record: Record) -> PromptExample:
    """Parse a ``prompt`` column; a conversation must not end with an assistant message."""
    fields = _present(record)
    if "prompt" not in fields:
        raise _missing_columns(record, _PROMPT_FORMS)
    prompt = _text(record, "prompt", fields["prompt"])
    if is_conversational(prompt) and prompt[-1]["role"] == "assistant":
        raise _error(
            record,
            f"column 'prompt': expected the last message to be for the assistant to answer, "
            f"found a message from the assistant: {_preview(prompt[-1]['content'])}",
        )
    return PromptExample(prompt=prompt)


def parse_stepwise(record: Record, separator: str) -> StepwiseExample:
    """Parse TRL's stepwise form: ``prompt`` (text or messages), ``completions`` (a list of non-empty step strings,
    none holding ``separator``, which the encoding puts after each step) and ``labels`` (one bool per step)."""
    fields = _present(record)
    if not {"prompt", "completions", "labels"} <= fields.keys():
        raise _missing_columns(record, _STEPWISE_FORMS)
    prompt = _text(record, "prompt", fields["prompt"])
    steps, labels = fields["completions"], fields["labels"]
    for column, value in (("completions", steps), ("labels", labels)):
        if not isinstance(value, list) or not value:
            raise _error(record, f"column {column!r}: expected a non-empty list, found {_found(value)}")
    if len(labels) != len(steps):
        raise _error(record, f"{len(labels)} labels for {len(steps)} steps: expected one label per step "
                             "(column 'labels' against column 'completions')")
    for index, (step, label) in enumerate(zip(steps, labels, strict=True), start=1):
        if not isinstance(step, str) or not step.strip():
            raise _error(record, f"column 'completions' step {index}: expected a non-empty string, found {_found(step)}")
        if separator in step:
            raise _error(record, f"column 'completions' step {index}: holds the step separator {separator!r}, which "
                                 f"marks where a step ends: {_preview(step)}")
        if not isinstance(label, bool):
            raise _error(record, f"column 'labels' label {index}: expected true (a right step) or false, "
                                 f"found {_found(label)}")
    return StepwiseExample(prompt=prompt, steps=list(steps), labels=list(labels))


def _text(record: Record, column: str, value: Any) -> Text:
    if isinstance(value, str):
        return _string(record, column, value)
    if isinstance(value, list):
        return _messages(record, column, value)
    raise _error(record, f"column {column!r}: expected a string or a list of messages, found {_found(value)}")


def _string(record: Record, column: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _error(record, f"column {column!r}: expected a string, found {_found(value)}")
    if not value.strip():
        raise _error(record, f"column {column!r}: expected a non-empty string, found {_preview(value)}")
    return value


def _messages(record: Record, column: str, value: Any) -> list[Message]:
    if not isinstance(value, list):
        raise _error(record, f"column {column!r}: expected a list of messages, found {_found(value)}")
    if not value:
        raise _error(record, f"column {column!r}: expected a non-empty list of messages, found []")
    return [
        _check_message(record, f"column {column!r} message {i} of {len(value)}", m)
        for i, m in enumerate(value, start=1)
    ]


def _check_message(record: Record, label: str, message: Any) -> Message:
    if not isinstance(message, dict):
        raise _error(record, f"{label}: expected a dict with 'role' and 'content', found {_found(message)}")
    missing = [key for key in ("role", "content") if key not in message]
    if missing:
        raise _error(
            record,
            f"{label}: expected keys 'role' and 'content', missing {' and '.join(map(repr, missing))} "
            f"(found keys: {', '.join(map(str, message)) or 'none'})",
        )
    role, content = message["role"], message["content"]
    if role not in _ROLES:
        raise _error(record, f"{label}: expected a role in {', '.join(_ROLES)}, found {_preview(role)}")
    if not isinstance(content, str):
        raise _error(record, f"{label}: expected 'content' to be a string, found {_found(content)}")
    calls = message.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list) or not all(
            isinstance(call, dict) and isinstance(call.get("function"), dict)
            and isinstance(call["function"].get("name"), str) for call in calls)):
        raise _error(record, f"{label}: expected 'tool_calls' only on an assistant message, as a list of "
                             '{"type": "function", "function": {"name": ..., "arguments": {...}}}, found '
                             f"{_preview(calls)}")
    if not content.strip() and not calls:
        raise _error(record, f"{label}: expected non-empty 'content', found {_preview(content)}")
    # Other keys (and nulls that Arrow adds for them) are dropped: role and content, and an assistant's tool
    # calls and a tool message's name, which chat templates render.
    kept = {"role": role, "content": content}
    if calls:
        kept["tool_calls"] = calls
    if role == "tool" and isinstance(message.get("name"), str):
        kept["name"] = message["name"]
    return kept


def _check_same_kind(record: Record, **texts: Text) -> None:
    if len({is_conversational(text) for text in texts.values()}) > 1:
        kinds = ", ".join(
            f"{column}: {'messages' if is_conversational(text) else 'string'}"
            for column, text in texts.items()
        )
        raise _error(
            record,
            f"columns {', '.join(texts)}: expected all strings or all message lists, found {kinds}",
        )


def _check_distinct(record: Record, chosen: Text, rejected: Text) -> None:
    if chosen == rejected:
        raise _error(
            record,
            "columns 'chosen' and 'rejected': expected two different responses, found identical values",
        )


def _check_ends_with_assistant(record: Record, column: str, messages: list[Message]) -> None:
    role = messages[-1]["role"]
    if role != "assistant":
        raise _error(
            record,
            f"column {column!r}: expected the last message to be from the assistant, found role {role!r}",
        )


def _common_prefix_length(a: str | list[Message], b: str | list[Message]) -> int:
    # Binary search over slice comparisons: the comparisons run in C, which matters for long transcripts.
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _split_shared_text(record: Record, chosen: str, rejected: str) -> tuple[str, str, str]:
    cut = _common_prefix_length(chosen, rejected)
    # Back off to the whitespace before the word the two responses split in, so neither starts mid-word
    # and both keep their leading whitespace (HH: prompt ends in "Assistant:", responses start with " ").
    while cut and not chosen[cut - 1].isspace():
        cut -= 1
    while cut and chosen[cut - 1].isspace():
        cut -= 1
    if cut == 0:
        raise _error(
            record,
            "columns 'chosen' and 'rejected': expected transcripts that start with a shared prompt, found "
            "them differing within their first word; give the prompt in a 'prompt' column",
        )
    prompt = chosen[:cut]
    for column, text in (("chosen", chosen), ("rejected", rejected)):
        if not text[cut:].strip():
            raise _error(
                record,
                f"column {column!r}: expected a response after the shared prompt, found nothing "
                f"after {_preview(prompt[-_PREVIEW_CHARS:])}",
            )
    return prompt, chosen[cut:], rejected[cut:]


def _split_shared_messages(
    record: Record, chosen: list[Message], rejected: list[Message]
) -> tuple[list[Message], list[Message], list[Message]]:
    cut = _common_prefix_length(chosen, rejected)
    if cut == 0:
        raise _error(
            record,
            "columns 'chosen' and 'rejected': expected conversations that start with shared prompt "
            "messages, found different first messages; give the prompt in a 'prompt' column",
        )
    for column, messages in (("chosen", chosen), ("rejected", rejected)):
        if len(messages) == cut:
            raise _error(
                record,
                f"column {column!r}: expected a reply after the {cut} shared prompt message(s), found none",
            )
        _check_ends_with_assistant(record, column, messages)
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _optional_number(record: Record, column: str, default: float | None = None) -> float | None:
    value = record.fields.get(column)
    if value is None:
        return default
    # bool is an int subclass, but a True/False margin is a data bug rather than a strength of 1 or 0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _error(record, f"column {column!r}: expected a finite number, found {_found(value)}")
    return float(value)
