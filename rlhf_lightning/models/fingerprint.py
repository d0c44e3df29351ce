"""Which weights an adapter was trained on: a content fingerprint of its base's weight files, saved beside it.

An adapter computes what it was trained to compute only on the weights it was trained on. Its
``adapter_config.json`` records the base's path, and a base retrained (or replaced) in place keeps its path: a
teacher or reward adapter would then load silently onto other weights. The fingerprint follows the content. It is
cheap at any model size: each weight file's name and size, its safetensors header (every tensor's name, dtype,
shape and offsets) and its bytes: all of them up to 64 MiB, else 256 blocks of 4 KiB spread evenly over the file (a
retrained model changes nearly every weight, so nearly every block). A base named by a hub id has none (its
revision names its weights); nor does a model built fresh from an ``architecture``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

BASE_RECORD = "base_fingerprint.json"  # written beside an exported adapter
SCHEME = 1  # how the fingerprint is computed; a record of another scheme is not compared
WHOLE_FILE_LIMIT = 64 * 2**20
BLOCKS, BLOCK_SIZE = 256, 4096
WEIGHT_PREFIXES = ("model", "pytorch_model")  # transformers' weight files, sharded or not
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def weight_files(folder: Path) -> list[Path]:
    """The model weight files of a ``save_pretrained`` folder (not a head, an adapter or training arguments)."""
    return sorted(path for path in folder.iterdir()
                  if path.is_file() and path.suffix in WEIGHT_SUFFIXES and path.name.startswith(WEIGHT_PREFIXES))


def _digest_file(path: Path, digest: hashlib.blake2b) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}\n".encode())
    with path.open("rb") as stream:
        if size <= WHOLE_FILE_LIMIT:
            while chunk := stream.read(2**20):
                digest.update(chunk)
            return
        if path.suffix == ".safetensors":  # 8 bytes of header length, then the header (JSON)
            (header_length,) = struct.unpack("<Q", stream.read(8))
            digest.update(stream.read(min(header_length, WHOLE_FILE_LIMIT)))
        for block in range(BLOCKS):
            stream.seek(block * (size - BLOCK_SIZE) // (BLOCKS - 1))
            digest.update(stream.read(BLOCK_SIZE))


def weights_fingerprint(name_or_path: str | None) -> str | None:
    """The fingerprint of the weights in the local folder ``name_or_path``; None for a hub id, a fresh model or a
    folder without weight files."""
    folder = Path(name_or_path).expanduser() if name_or_path else None
    files = weight_files(folder) if folder is not None and folder.is_dir() else []
    if not files:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for path in files:
        _digest_file(path, digest)
    return digest.hexdigest()


def write_base_record(adapter_dir: Path, base_name: str, fingerprint: str) -> None:
    """Record beside an exported adapter which weights it was trained on."""
    record = {"base_model_name_or_path": base_name, "fingerprint": fingerprint, "scheme": SCHEME}
    (adapter_dir / BASE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def recorded_fingerprint(adapter_dir: str | Path) -> str | None:
    """The base fingerprint recorded beside an adapter; None for an adapter exported before fingerprints were
    recorded (or under another scheme)."""
    path = Path(adapter_dir) / BASE_RECORD
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record.get("fingerprint") if record.get("scheme") == SCHEME else None
