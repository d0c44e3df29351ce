"""Reading back an offline W&B run (the ``run-<id>.wandb`` file) without a server.

Tests and the study use it to check what a run really logged. The file is a LevelDB-style log of protobuf
``Record`` messages: a 7-byte file header, then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32,
length, type: full, first, middle or last piece of a record).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    position, pieces = HEADER, []
    while position + HEADER <= len(data):
        space_in_block = BLOCK - position % BLOCK
        if space_in_block < HEADER:  # the writer pads the tail of a block that cannot hold a header
            position += space_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        payload = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        pieces.append(payload)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def find_run_file(directory: str | Path) -> Path:
    """The newest ``run-*.wandb`` file under ``directory`` (a save dir, a wandb dir or a run dir)."""
    files = sorted(Path(directory).rglob("run-*.wandb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file under {directory}")
    return files[-1]


def read_history(run_file: str | Path) -> list[dict[str, Any]]:
    """Every ``log`` call of the run, in order, as ``{key: value}`` dicts (``_step`` included)."""
    rows = []
    for record in _records(Path(run_file)):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def read_config(run_file: str | Path) -> dict[str, Any]:
    """The run's config, merged from every config update."""
    config: dict[str, Any] = {}
    for record in _records(Path(run_file)):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config
