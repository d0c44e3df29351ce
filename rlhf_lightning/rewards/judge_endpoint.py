"""A judge behind an OpenAI-compatible endpoint (vLLM, ``transformers serve``, a hosted API), reached through
:func:`~rlhf_lightning.rewards.http.post_json` (a timeout per try, retries with back-off, one line naming the
endpoint).

A text template goes to ``/completions`` (``batch_size`` prompts per request, as a list when more than one), a chat
template to ``/chat/completions`` (one conversation per request). Requests ask for ``temperature: 0`` and a fixed
``seed``, so a deterministic server answers a resumed run as it answered the uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import httpx

from rlhf_lightning.rewards.http import EndpointError, post_json

TOP_LOGPROBS = 20  # alternatives asked for per token when reading label probabilities (OpenAI's maximum)
COMPLETIONS_SCHEMA = "{choices: [{index, text, logprobs: {top_logprobs: [{token: logprob}]}}]}"
CHAT_SCHEMA = "{choices: [{message: {content}, logprobs: {content: [{top_logprobs: [{token, logprob}]}]}}]}"


def _preview(answer: Any) -> str:
    text = json.dumps(answer) if not isinstance(answer, str) else answer
    return text if len(text) <= 160 else text[:157] + "..."


class EndpointJudge:
    """Answers judge prompts through an OpenAI-compatible server.

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name sent with each request.
        api_key_env: the environment variable holding the API key (sent as a bearer token); None = no key.
        max_new_tokens: ``max_tokens`` of an answer.
        seed: the ``seed`` of each request.
        batch_size: prompts per ``/completions`` request.
        timeout, retries, backoff, retry_for: of each request (see :func:`~rlhf_lightning.rewards.http.post_json`).
    """

    def __init__(self, base_url: str, model: str, api_key_env: str | None, max_new_tokens: int, seed: int,
                 batch_size: int, timeout: float, retries: int, backoff: float, retry_for: float = 0.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model, self.max_new_tokens, self.seed, self.batch_size = model, max_new_tokens, seed, batch_size
        self.timeout, self.retries, self.backoff, self.retry_for = timeout, retries, backoff, retry_for
        self.headers = {}
        if api_key_env is not None:
            key = os.environ.get(api_key_env, "")
            if not key:
                raise ValueError(f"JudgeReward endpoint {self.base_url}: the environment variable {api_key_env} "
                                 "(api_key_env) is not set or empty; export the API key there")
            self.headers["Authorization"] = f"Bearer {key}"
        self.client = httpx.Client()

    @property
    def label(self) -> str:
        return f"judge {self.model} at"

    def _post(self, path: str, payload: dict[str, Any]) -> Any:
        return post_json(f"{self.base_url}{path}", {"model": self.model, "temperature": 0, "seed": self.seed,
                                                    **payload},
                         timeout=self.timeout, retries=self.retries, backoff=self.backoff, headers=self.headers,
                         what=self.label, client=self.client, retry_for=self.retry_for)

    def _wrong_schema(self, path: str, expected: str, answer: Any) -> EndpointError:
        return EndpointError(f"{self.label} {self.base_url}{path}: the answer does not follow the OpenAI schema "
                             f"{expected}: got {_preview(answer)}")

    def _choices(self, path: str, answer: Any, count: int, expected: str) -> list[dict[str, Any]]:
        """The answer's ``choices``, in the order of the prompts (by ``index`` when given)."""
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != count or not all(isinstance(c, dict) for c in choices):
            raise self._wrong_schema(path, expected, answer)
        if all(isinstance(choice.get("index"), int) for choice in choices):
            choices = sorted(choices, key=lambda choice: choice["index"])
        return choices

    def _requests(self, prompts: list[Any], extra: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Each prompt's choice: batched ``/completions`` for text, one ``/chat/completions`` per conversation."""
        answers = []
        if prompts and isinstance(prompts[0], list):
            for messages in prompts:
                answer = self._post("/chat/completions", {"messages": messages, **extra})
                answers += [("/chat/completions", c) for c in self._choices("/chat/completions", answer, 1,
                                                                           CHAT_SCHEMA)]
            return answers
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start:start + self.batch_size]
            answer = self._post("/completions", {"prompt": batch if len(batch) > 1 else batch[0], **extra})
            answers += [("/completions", c) for c in self._choices("/completions", answer, len(batch),
                                                                    COMPLETIONS_SCHEMA)]
        return answers

    def answers(self, prompts: list[Any]) -> list[str]:
        """The endpoint's answer to each prompt, as text."""
        texts = []
        for path, choice in self._requests(prompts, {"max_tokens": self.max_new_tokens}):
            text = choice.get("message", {}).get("content") if path == "/chat/completions" else choice.get("text")
            if not isinstance(text, str):
                raise self._wrong_schema(path, CHAT_SCHEMA if path == "/chat/completions" else COMPLETIONS_SCHEMA,
                                         choice)
            texts.append(text)
        return texts

    def label_probabilities(self, prompts: list[Any], labels: list[str]) -> list[list[float]]:
        """Each label's probability as the first token of the answer, from the endpoint's top log-probs (0 for a
        label not among them)."""
        chat = bool(prompts) and isinstance(prompts[0], list)
        extra = {"max_tokens": 1, **({"logprobs": True, "top_logprobs": TOP_LOGPROBS} if chat
                                     else {"logprobs": TOP_LOGPROBS})}
        rows = []
        for path, choice in self._requests(prompts, extra):
            top = self._first_token_alternatives(path, choice)
            rows.append([sum(math.exp(logprob) for token, logprob in top.items() if token.strip() == label.strip())
                         for label in labels])
        return rows

    def _first_token_alternatives(self, path: str, choice: dict[str, Any]) -> dict[str, float]:
        """``{token: logprob}`` of the first answer token's alternatives in either schema."""
        logprobs = choice.get("logprobs")
        try:
            if path == "/chat/completions":
                return {item["token"]: float(item["logprob"]) for item in logprobs["content"][0]["top_logprobs"]}
            return {token: float(value) for token, value in logprobs["top_logprobs"][0].items()}
        except (TypeError, KeyError, IndexError, ValueError, AttributeError):
            raise self._wrong_schema(path, CHAT_SCHEMA if path == "/chat/completions" else COMPLETIONS_SCHEMA,
                                     choice) from None
