"""Reading back an offline W&B run (the ``run-<id>.wandb`` file) without a server.

Tests and the study use it to check what a run really logged. The file is a LevelDB-style log of protobuf
``Record`` messages: a 7-byte file header, then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32,
length, type: full, first, middle or last piece of a record).
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path, start: int = 0):
    """The records of ``path`` whose first chunk lies at or after byte ``start`` (rounded down to a block)."""
    from wandb.proto import wandb_internal_pb2

    with path.open("rb") as file:
        if file.read(4) != b":W&B":
            raise ValueError(f"{path} is not a W&B run file")
        position = max(HEADER, start // BLOCK * BLOCK)
        file.seek(position)
        data = file.read()
    offset, pieces, in_record = position, [], False
    while offset + HEADER <= position + len(data):
        space_in_block = BLOCK - offset % BLOCK
        if space_in_block < HEADER:  # the writer pads the tail of a block that cannot hold a header
            offset += space_in_block
            continue
        local = offset - position
        _, length, kind = struct.unpack("<IHB", data[local : local + HEADER])
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        if local + HEADER + length > len(data):  # a chunk the writer is still writing
            break
        payload = data[local + HEADER : local + HEADER + length]
        offset += HEADER + length
        if kind in (FULL, FIRST):
            in_record, pieces = True, []
        if not in_record:  # the tail of a record that began before ``start``
            continue
        pieces.append(payload)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            in_record = False
            yield record


def is_finished(run_file: str | Path) -> bool:
    """Whether W&B has written the run's exit record, its last: everything the run logged is then on disk.
    Only the file's last two blocks are read, so this is cheap on a long run."""
    path = Path(run_file)
    start = max(0, path.stat().st_size - 2 * BLOCK)
    return any(record.WhichOneof("record_type") == "exit" for record in _records(path, start))


def wait_until_finished(run_file: str | Path, timeout: float = 60.0) -> bool:
    """Wait until :func:`is_finished`, at most ``timeout`` seconds; whether it is.

    ``wandb.finish()`` returns before W&B's service process has written the run's last records, so a run read
    straight after it (a study, a sweep trial, a test) may miss its last history rows."""
    deadline = time.monotonic() + timeout
    while not (Path(run_file).is_file() and is_finished(run_file)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def has_history(run_file: str | Path) -> bool:
    """Whether the run logged anything (a run that failed before its first ``log`` call has no history)."""
    return any(record.WhichOneof("record_type") == "history" for record in _records(Path(run_file)))


def find_run_file(directory: str | Path) -> Path:
    """The newest ``run-*.wandb`` file under ``directory`` (a save dir such as ``outputs/ppo``, its ``wandb``
    folder or a run folder) that logged something: runs that failed before logging are skipped."""
    files = sorted(Path(directory).rglob("run-*.wandb"), key=lambda p: p.stat().st_mtime, reverse=True)
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file under {directory}")
    for path in files:
        if has_history(path):
            return path
    raise FileNotFoundError(f"no W&B run with logged history under {directory} ({len(files)} empty run(s), "
                            f"e.g. {files[0]})")


def _run_file(path: str | Path) -> Path:
    path = Path(path)
    return find_run_file(path) if path.is_dir() else path


def read_history(run: str | Path) -> list[dict[str, Any]]:
    """Every ``log`` call of the run, in order, as ``{key: value}`` dicts (``_step`` included). ``run`` is a
    ``run-*.wandb`` file or a folder (``outputs/ppo/wandb``...), which means its latest run with history."""
    rows = []
    for record in _records(_run_file(run)):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def read_config(run: str | Path) -> dict[str, Any]:
    """The run's config, merged from every config update; ``run`` as in :func:`read_history`."""
    config: dict[str, Any] = {}
    for record in _records(_run_file(run)):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config
