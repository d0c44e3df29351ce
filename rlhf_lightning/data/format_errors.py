"""The parsers' errors (:mod:`rlhf_lightning.data.formats`): each names the record's place, the column, what was
expected and what was found, with a column name that holds what the eye would miss quoted."""

from __future__ import annotations

import re
from typing import Any

from rlhf_lightning.data.sources import DataFormatError, Record

_PREVIEW_CHARS = 80


def _error(record: Record, problem: str) -> DataFormatError:
    return DataFormatError(f"{record.where}: {problem}")


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _PREVIEW_CHARS else text[:_PREVIEW_CHARS] + "..."


def _found(value: Any) -> str:
    return f"{type(value).__name__} {_preview(value)}"


def _present(record: Record) -> dict[str, Any]:
    return {name: value for name, value in record.fields.items() if value is not None}


def _shown(name: str) -> str:
    """A column's name as the error shows it: quoted when it holds what the eye would miss (spaces, nothing)."""
    return name if name.isidentifier() else repr(name)


def _missing_columns(record: Record, forms: str) -> DataFormatError:
    found = ", ".join(_shown(name) for name in sorted(_present(record))) or "none"
    nulls = sorted(name for name, value in record.fields.items() if value is None)
    null_note = f" (null: {', '.join(_shown(name) for name in nulls)})" if nulls else ""
    expected = set(re.findall(r"\w+", forms))
    spaced = [name for name in record.fields if name != name.strip() and name.strip() in expected]
    space_note = "".join(f"; column {name!r} has spaces around its name (it should read {name.strip()!r})"
                         for name in spaced)
    return _error(record, f"missing columns: expected {forms}; found columns: {found}{null_note}{space_note}")
