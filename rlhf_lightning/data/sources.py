"""Read raw rows from local files or `datasets` sources, each tagged with where it came from.

Every row becomes a :class:`Record` whose ``where`` says, for a human, where to look when that row turns
out to be malformed ("data/prefs.jsonl line 17", "Anthropic/hh-rlhf[train] row 17"). Parsing the fields
into typed examples is the job of :mod:`rlhf_lightning.data.formats`.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_PREVIEW_CHARS = 80


class DataFormatError(ValueError):
    """Input data that cannot be used; the message names where it is and what was expected vs found."""


class Record(NamedTuple):
    """One raw row: ``where`` is a 1-based human-readable location, ``fields`` the row's columns."""

    where: str
    fields: dict[str, Any]


def read_records(dataset: str, split: str = "train") -> list[Record]:
    """Read every row of ``dataset`` as plain Python dicts.

    ``dataset`` is a local ``.jsonl`` / ``.json`` / ``.parquet`` file, a folder written by ``datasets``'
    ``save_to_disk`` (``split`` picks the split of a DatasetDict), or anything ``datasets.load_dataset``
    understands (another local folder, a hub id). Raises :class:`DataFormatError` for unreadable or empty
    sources and for rows that are not JSON objects.
    """
    dataset = os.fspath(dataset)
    suffix = os.path.splitext(dataset)[1].lower()
    if suffix in _FILE_SUFFIXES and not os.path.isdir(dataset):
        # A file-looking name that is missing is a typo, not a hub id: say so instead of querying the hub.
        if not os.path.isfile(dataset):
            raise DataFormatError(f"{dataset}: file not found (expected a local {suffix} file)")
        if suffix == ".jsonl":
            records = _read_json_lines(dataset, _read_text(dataset))
        elif suffix == ".json":
            records = _read_json(dataset)
        else:
            records = _read_parquet(dataset)
    elif _is_saved_to_disk(dataset):
        records = _read_saved_to_disk(dataset, split)
    else:
        records = _read_with_load_dataset(dataset, split)
    if not records:
        raise DataFormatError(f"{dataset}: no rows found (expected at least one row, found an empty source)")
    return records


def _preview(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _PREVIEW_CHARS else text[:_PREVIEW_CHARS] + "...")


def _read_text(path: str) -> str:
    try:
        # utf-8-sig: files saved by some editors start with a byte-order mark that json rejects.
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise DataFormatError(f"{path}: expected UTF-8 text, found undecodable bytes ({err})") from err


def _row_record(where: str, row: Any) -> Record:
    if not isinstance(row, dict):
        raise DataFormatError(
            f"{where}: expected a JSON object, found {type(row).__name__}: {_preview(json.dumps(row))}"
        )
    return Record(where, row)


def _read_json_lines(path: str, text: str) -> list[Record]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{where}: invalid JSON ({err.msg}): {_preview(line)}") from err
        records.append(_row_record(where, row))
    return records


def _read_json(path: str) -> list[Record]:
    text = _read_text(path)
    if not text.lstrip().startswith("["):
        return _read_json_lines_or_explain(path, text)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        # Point at the offending line of the document, since that is where the researcher has to look.
        lines = text.splitlines()
        bad_line = lines[err.lineno - 1] if err.lineno <= len(lines) else ""
        raise DataFormatError(
            f"{path} line {err.lineno}: invalid JSON ({err.msg} at column {err.colno}): {_preview(bad_line)}"
        ) from err
    return [_row_record(f"{path} row {number}", row) for number, row in enumerate(rows, start=1)]


def _read_json_lines_or_explain(path: str, text: str) -> list[Record]:
    try:
        return _read_json_lines(path, text)
    except DataFormatError as line_error:
        document_type = _json_document_type(text)
        if document_type is None:
            raise
        # A pretty-printed object (e.g. {"train": [...]}) fails line by line; the line error would mislead.
        raise DataFormatError(
            f"{path}: expected a JSON list of objects or one JSON object per line, "
            f"found a single JSON {document_type} spanning several lines"
        ) from line_error


def _json_document_type(text: str) -> str | None:
    try:
        return type(json.loads(text)).__name__
    except json.JSONDecodeError:
        return None


def _read_parquet(path: str) -> list[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise DataFormatError(f"{path}: could not read as a Parquet file: {err}") from err
    return [Record(f"{path} row {number}", row) for number, row in enumerate(rows, start=1)]


def _is_saved_to_disk(path: str) -> bool:
    markers = ("dataset_dict.json", "state.json")
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in markers)


def _read_saved_to_disk(path: str, split: str) -> list[Record]:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as err:  # the library raises many unrelated types; all mean "unreadable folder"
        raise DataFormatError(f"{path}: could not load the saved dataset: {err}") from err
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataFormatError(
                f"{path}: split {split!r} not found; available splits: {', '.join(sorted(loaded))}"
            )
        return _dataset_records(f"{path}[{split}]", loaded[split])
    return _dataset_records(path, loaded)


def _read_with_load_dataset(dataset: str, split: str) -> list[Record]:
    import datasets

    try:
        loaded = datasets.load_dataset(dataset, split=split)
    except Exception as err:  # hub, network, builder and split errors all surface here with varied types
        raise DataFormatError(
            f"{dataset}[{split}]: could not load dataset {dataset!r} split {split!r}: {err}"
        ) from err
    return _dataset_records(f"{dataset}[{split}]", loaded)


def _dataset_records(source: str, dataset: Any) -> list[Record]:
    return [Record(f"{source} row {number}", row) for number, row in enumerate(dataset.to_list(), start=1)]
