"""What the reward server and its client agree on: the tokenizer's identity, and how scores travel in JSON.

``POST /score`` takes ``{"prompts": [...], "completions": [...], "completion_ids": [[...]]?, "input_ids": [[...]]?,
"attention_mask": [[...]]?, "columns": {name: [...]}?}`` and answers ``{"scores": [...]}``, one per completion. JSON has no NaN or infinity,
so a score is a number, ``null`` for NaN (the source's "not applicable", or a reward model's failure), or the
string ``"inf"``/``"-inf"``. ``GET /info`` answers :data:`INFO_KEYS`. See docs/reward-server.md.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from transformers import PreTrainedTokenizerBase

SCHEMA_VERSION = 1
INFO_KEYS = ("schema", "source", "statistics", "tokenizer", "max_batch_size", "served")
INFINITIES = {"inf": math.inf, "-inf": -math.inf}
# The environment variable holding the bearer token, on the server (which then requires it) and its clients.
TOKEN_VARIABLE = "RLHF_LIGHTNING_REWARD_TOKEN"


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What must match for token ids to mean the same tokens on both sides: the vocabulary (every token and its
    id, added tokens included) and the EOS id, as a fingerprint; the name and size are there to be read."""
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.blake2b(json.dumps([vocabulary, tokenizer.eos_token_id]).encode(), digest_size=16)
    return {"name": str(tokenizer.name_or_path), "size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "fingerprint": digest.hexdigest()}


def encode_score(score: float) -> float | str | None:
    """A score as JSON carries it: a number, ``null`` for NaN, ``"inf"``/``"-inf"``."""
    if math.isnan(score):
        return None
    if math.isinf(score):
        return "inf" if score > 0 else "-inf"
    return score


def decode_score(value: Any) -> float:
    """The float of an encoded score; ``ValueError`` for anything :func:`encode_score` does not write."""
    if value is None:
        return math.nan
    if isinstance(value, str) and value in INFINITIES:
        return INFINITIES[value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{value!r} is not a score (expected a number, null or 'inf'/'-inf')")
    return float(value)
