"""A reward source scored by a reward server (``python -m rlhf_lightning serve-reward``) over HTTP."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import httpx
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rewards.http import EndpointError, get_json, post_json
from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.rewards.remote_protocol import (
    INFO_KEYS,
    SCHEMA_VERSION,
    TOKEN_VARIABLE,
    decode_score,
    tokenizer_identity,
)
from rlhf_lightning.rewards.sources import RewardSource
from rlhf_lightning.utils import checks


class RemoteReward(RewardSource):
    """The reward source a reward server serves (``python -m rlhf_lightning serve-reward``, docs/reward-server.md):
    many runs share one loaded reward model, on another GPU or machine.

    At setup it reads the server's ``/info``: a server that does not answer stops the run there, before any rollout;
    the server's tokenizer must be this run's (the same vocabulary and EOS id), since responses travel as this run's
    token ids, in this batch's layout (its padding), and are scored as sampled; the source's statistics serve
    ``reward_shaping.normalize``. Each batch is posted in chunks of ``batch_size`` rows. Scores equal the served
    source's in this process: bit for bit when the server scores the chunk alone on the same kind of device, to float
    rounding (about 1e-6) when it joins it with another run's rows of the same width.

    Args:
        url: the server's address, e.g. ``http://127.0.0.1:8000``.
        timeout: seconds one request may take before it is tried again.
        retries: tries after the first, for a server that does not answer, times out or answers 408/429/5xx (at
            setup, only these: a wrong url fails at once).
        retry_for: during the run, go on trying for this many seconds after a scoring request first failed (a
            server restarting is waited for, not a lost run); 0 = ``retries`` alone.
        backoff: seconds before the first retry, doubled before each next one.
        batch_size: rows per request at most.
        name: the label of the source's metrics (``objective/score/<name>``); null = the served source's name.
        token_variable: the environment variable whose value is sent as a bearer token (``Authorization: Bearer``)
            when it is set: the server's token (kept out of configs and logs).
    """

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0,
                 batch_size: int = 256, name: str | None = None, token_variable: str = TOKEN_VARIABLE,
                 retry_for: float = 180.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"RemoteReward url {url!r}: expected http://HOST:PORT (the address serve-reward printed)")
        checks.positive("RemoteReward timeout", timeout)
        checks.at_least("RemoteReward retries", retries, minimum=0)
        checks.non_negative("RemoteReward backoff", backoff)
        checks.non_negative("RemoteReward retry_for", retry_for)
        checks.at_least("RemoteReward batch_size", batch_size)
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff, self.batch_size = timeout, retries, backoff, batch_size
        self.retry_for = retry_for
        self._name, self.token_variable = name, token_variable
        self.may_abstain = False  # until the server says what its source does
        self.client: httpx.Client | None = None

    @property
    def name(self) -> str:
        return self._name or "remote_reward"

    @property
    def what(self) -> str:
        return f"RemoteReward {self.url}"

    def request(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        if self.client is None:
            self.client = httpx.Client()  # one connection, kept open between requests
        token = os.environ.get(self.token_variable)  # read at each request: a token rotated mid-run is picked up
        options = {"timeout": self.timeout, "retries": self.retries, "backoff": self.backoff, "what": "RemoteReward",
                   "client": self.client, "headers": {"Authorization": f"Bearer {token}"} if token else None}
        if payload is None:  # /info, at setup: a wrong url or a server not started fails at once
            return get_json(f"{self.url}{path}", **options)
        return post_json(f"{self.url}{path}", payload, **options, retry_for=self.retry_for)

    def setup(self, base: SharedBase | None, tokenizer: PreTrainedTokenizerBase) -> None:
        """Read the server's ``/info``: its source's name, whether it may abstain and its statistics; refuse a
        server that is down, is not a reward server, or tokenizes otherwise than ``tokenizer``."""
        info = self.request("/info")
        if not isinstance(info, dict) or not set(INFO_KEYS) <= set(info) or info["schema"] != SCHEMA_VERSION:
            got = sorted(info) if isinstance(info, dict) else type(info).__name__
            raise ValueError(f"{self.what}/info: not a reward server's answer (expected schema {SCHEMA_VERSION} with "
                             f"keys {', '.join(INFO_KEYS)}; got {got}): is the url serve-reward's?")
        theirs, ours = info["tokenizer"], tokenizer_identity(tokenizer)
        if theirs.get("fingerprint") != ours["fingerprint"]:
            raise ValueError(
                f"{self.what}: the server's tokenizer ({theirs.get('name')}, {theirs.get('size')} tokens, EOS "
                f"{theirs.get('eos_token_id')}) is not this run's ({ours['name']}, {ours['size']} tokens, EOS "
                f"{ours['eos_token_id']}): responses travel as token ids, which would mean other tokens there; serve "
                "the reward on this run's base (the model the reward adapter was trained on)")
        source, stats = info["source"], info["statistics"]
        self._name = self._name or source["name"]
        self.may_abstain = bool(source["may_abstain"])
        self.statistics = None if stats is None else (float(stats["mean"]), float(stats["std"]))

    def payload(self, inputs: RewardInputs, start: int, stop: int) -> dict[str, Any]:
        """Rows ``start:stop`` as ``POST /score`` takes them: the sequences in this batch's own layout (padding and
        attention mask), which the server scores unchanged: the same numbers as in this process."""
        payload = {"prompts": inputs.prompts[start:stop], "completions": inputs.completions[start:stop],
                   "completion_ids": inputs.completion_ids[start:stop],
                   "input_ids": inputs.input_ids[start:stop].tolist(),
                   "attention_mask": inputs.attention_mask[start:stop].tolist(),
                   "columns": {name: values[start:stop] for name, values in inputs.columns.items()}}
        for name, values in payload["columns"].items():
            try:
                json.dumps(values)
            except (TypeError, ValueError) as error:
                raise ValueError(f"{self.what}: column {name!r} holds a value JSON cannot carry ({error})") from None
        return payload

    def score(self, inputs: RewardInputs) -> Tensor:
        count = len(inputs.completions)
        values: list[float] = []
        for start in range(0, count, self.batch_size):
            stop = min(start + self.batch_size, count)
            try:
                answer = self.request("/score", self.payload(inputs, start, stop))
            except EndpointError as error:
                if count <= self.batch_size:
                    raise
                # The server numbers the rows of its request: say where they start.
                raise EndpointError(f"{error} (the request of rows {start}-{stop - 1})") from None
            values += self.read_scores(answer, inputs, start, stop)
        return torch.tensor(values, dtype=torch.float32, device=inputs.input_ids.device)

    def read_scores(self, answer: Any, inputs: RewardInputs, start: int, stop: int) -> list[float]:
        """The scores of rows ``start:stop`` in the server's ``answer``, refused in one line naming the row when
        one is not a score, or is NaN (null) from a source that cannot abstain, or infinite."""
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            got = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
            raise ValueError(f"{self.what}/score: expected {{\"scores\": [one per completion]}}, got {got}")
        if len(scores) != stop - start:
            raise ValueError(f"{self.what}/score returned {len(scores)} scores for {stop - start} completions "
                             f"(rows {start}-{stop - 1})")
        values = []
        for row, value in enumerate(scores, start):
            where = f"{self.what}/score: row {row} (completion {inputs.completions[row]!r})"
            try:
                score = decode_score(value)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            if math.isinf(score) or (math.isnan(score) and not self.may_abstain):
                shown = "null (NaN)" if value is None else repr(value)
                raise ValueError(f"{where}: the served source {self.name!r} gave {shown}: expected a finite float"
                                 f"{', or null for not applicable' if self.may_abstain else ''}")
            values.append(score)
        return values
