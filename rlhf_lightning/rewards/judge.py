"""LLM judges as a reward source: a prompt template, a judge (the shared base, a local model or an endpoint) and a
parser that turns its answer into a score. See docs/judges.md."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.rewards.judge_endpoint import EndpointJudge
from rlhf_lightning.rewards.judge_local import LocalJudge
from rlhf_lightning.rewards.judge_parsers import (
    ParserName,
    check_parser,
    expected_score,
    lowest_score,
    parse_label,
    parse_number,
)
from rlhf_lightning.rewards.judge_template import JudgeTemplate, Messages
from rlhf_lightning.rewards.sources import RewardSource
from rlhf_lightning.utils import checks


class JudgeReward(RewardSource):
    """An LLM judge as a reward source: each response is put into a prompt ``template``, the judge answers, and
    ``parser`` turns the answer into a score.

    The judge is (a) the policy's shared base itself (default): with adapters disabled, i.e. the reference (SFT)
    model, or with a judge LoRA ``adapter`` loaded onto it (no second copy of the weights); (b) a separate local
    causal LM (``model``: its folder); or (c) an OpenAI-compatible endpoint (``base_url`` and ``model``). Decoding
    is deterministic (greedy in-process, ``temperature: 0`` and ``seed`` for an endpoint) and draws from no training
    random stream, so a resumed run gets the same scores.

    A parse failure (no number, a number outside [low, high], no label) gives the row ``failure_score``; the
    failures are counted and logged every iteration as ``objective/<name>/parse_failures`` and
    ``objective/<name>/parse_failure_rate``, and the first failing answer is quoted once in a warning.

    Args:
        template: the judge's prompt: a Python format string, or a chat (a list of ``{role, content}`` messages)
            whose contents are format strings. Fields: ``{prompt}`` (the prompt text; a conversation's last user
            message), ``{response}`` (the response text) and any column of the prompt data, e.g. ``{answer}``; a
            literal brace is written ``{{`` or ``}}``.
        parser: ``number``: the answer's first number, in [low, high], mapped linearly to [0, 1]; ``labels``: the
            score of the label the answer starts with (case ignored); ``logprob``: no answer is generated, the
            labels' probabilities as the judge's next token (one forward pass; each label must be one token) are
            renormalised over the labels and average their scores (P(yes) for ``{yes: 1, no: 0}``).
        low: the lowest number the ``number`` parser accepts (scores 0).
        high: the highest number the ``number`` parser accepts (scores 1).
        labels: label -> score, for ``labels`` and ``logprob``, e.g. ``{" yes": 1.0, " no": 0.0}``.
        failure_score: the score of a row whose answer cannot be parsed: a number, ``lowest`` (the parser's lowest
            score: 0 for ``number``, the smallest label score) or ``abstain`` (NaN: "not applicable", the row's
            reward is then the other reward sources' sum; with no other source the run stops).
        model: None = the shared base; a local folder = a separate causal LM (with its tokenizer); with
            ``base_url``, the model name sent to the endpoint.
        adapter: folder of a LoRA adapter trained on the shared base (peft format, e.g. exported by the SFT stage
            with ``export_format: adapter``), loaded as a role named ``name``; None = the base with adapters
            disabled.
        base_url: the API root of an OpenAI-compatible server, e.g. ``http://127.0.0.1:8000/v1``; None = a local
            judge.
        api_key_env: the environment variable that holds the endpoint's API key (never the key itself); None =
            send none.
        max_new_tokens: tokens of the judge's answer at most (greedy).
        max_length: an in-process judge's prompt is cut from the left to this many tokens; None = the judge
            model's positions less ``max_new_tokens`` (all of them for ``logprob``).
        batch_size: judge prompts per forward pass, or per ``/completions`` request.
        timeout: seconds an endpoint request may take, per try.
        retries: tries after the first on a connection error, timeout, HTTP 408/429/5xx.
        backoff: seconds before the first retry, doubled for each next one.
        retry_for: go on trying an endpoint request for this many seconds after it first failed (a server
            restarting, a rate limit); 0 = ``retries`` alone.
        seed: the ``seed`` sent with each endpoint request.
        name: labels the judge's metrics: ``objective/<name>/parse_failures``.
    """

    def __init__(
        self,
        template: str | Messages,
        parser: ParserName = "number",
        low: float = 0.0,
        high: float = 10.0,
        labels: dict[str, float] | None = None,
        failure_score: float | Literal["lowest", "abstain"] = "lowest",
        model: str | None = None,
        adapter: str | None = None,
        base_url: str | None = None,
        api_key_env: str | None = None,
        max_new_tokens: int = 8,
        max_length: int | None = None,
        batch_size: int = 16,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        retry_for: float = 180.0,
        seed: int = 0,
        name: str = "judge",
    ) -> None:
        self.template = JudgeTemplate(template)
        check_parser(parser, low, high, labels)
        for key, value in {"max_new_tokens": max_new_tokens, "batch_size": batch_size}.items():
            checks.at_least(key, value)
        checks.at_least("max_length", max_length, optional=True)
        checks.positive("timeout", timeout)
        checks.at_least("retries", retries, minimum=0)
        checks.non_negative("backoff", backoff)
        checks.non_negative("retry_for", retry_for)
        model, adapter, base_url, api_key_env = (checks.optional_str(value)
                                                 for value in (model, adapter, base_url, api_key_env))
        if isinstance(failure_score, str) and failure_score not in ("lowest", "abstain"):
            raise ValueError(f"JudgeReward failure_score: expected a number, lowest or abstain, got {failure_score!r}")
        if isinstance(failure_score, int | float) and not math.isfinite(failure_score):
            raise ValueError(f"JudgeReward failure_score: {failure_score} is not finite; write abstain for NaN")
        if base_url is not None and model is None:
            raise ValueError(f"JudgeReward base_url {base_url}: set model, the model name the endpoint serves")
        if adapter is not None and (model is not None or base_url is not None):
            raise ValueError("JudgeReward adapter: a judge adapter is loaded onto the shared base; it cannot go with "
                             f"model ({model}) or base_url ({base_url})")
        if api_key_env is not None and base_url is None:
            raise ValueError(f"JudgeReward api_key_env {api_key_env}: only an endpoint judge (base_url) takes a key")
        if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"JudgeReward adapter {adapter}: no adapter_config.json there; train one with "
                                    "the SFT stage (lora, export_format: adapter) or fix the path")
        self.parser, self.low, self.high, self.labels = parser, float(low), float(high), dict(labels or {})
        self.failure = (math.nan if failure_score == "abstain" else
                        lowest_score(parser, self.labels) if failure_score == "lowest" else float(failure_score))
        self.model, self.adapter, self.base_url, self.api_key_env = model, adapter, base_url, api_key_env
        self.max_new_tokens, self.max_length, self.batch_size = max_new_tokens, max_length, batch_size
        self.timeout, self.retries, self.backoff, self.seed = timeout, retries, backoff, seed
        self.retry_for = retry_for
        self.judge_name = name
        self.judge: LocalJudge | EndpointJudge | None = None
        self.label_ids: list[int] = []
        self.last_failures = (0, 0)  # (failures, rows) of the latest score() call
        self.warned = False

    @property
    def name(self) -> str:
        return self.judge_name

    @property
    def describe(self) -> str:
        """Which judge this is, for messages."""
        if self.base_url is not None:
            return f"endpoint {self.base_url} ({self.model})"
        if self.model is not None:
            return f"model {self.model}"
        return f"shared base with adapter {self.adapter}" if self.adapter else "shared base (adapters disabled)"

    # ---- setup ------------------------------------------------------------------------------------------

    def setup(self, base: SharedBase, tokenizer: PreTrainedTokenizerBase) -> None:
        if self.base_url is not None:
            self.judge = EndpointJudge(self.base_url, self.model, self.api_key_env, self.max_new_tokens, self.seed,
                                       self.batch_size, self.timeout, self.retries, self.backoff, self.retry_for)
            return
        role = None
        if self.model is not None:
            base, tokenizer = self._separate_model(base)
        elif self.adapter is not None:
            role = self.name  # each judge adapter is a role of its own on the shared base
            if role in base.adapters:
                raise ValueError(f"JudgeReward adapter {self.adapter}: the base already has an adapter named {role!r}; "
                                 "give each judge its own name")
            base.load_adapter(self.adapter, role, trainable=False)
        positions = getattr(base.hf_model.config, "max_position_embeddings", None) or 4096
        # logprob reads the next token's distribution and generates nothing: the prompt may fill every position
        max_length = self.max_length or positions - (0 if self.parser == "logprob" else self.max_new_tokens)
        self.judge = LocalJudge(base, role, tokenizer, self.max_new_tokens, max_length, self.batch_size,
                                f"JudgeReward {self.describe}")
        if self.parser == "logprob":
            self.label_ids = [self.judge.label_token(label) for label in self.labels]

    def _separate_model(self, policy_base: SharedBase) -> tuple[SharedBase, PreTrainedTokenizerBase]:
        """The judge model of ``model``, frozen, in a shared base of its own, on the policy's device."""
        from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
        from rlhf_lightning.models.spec import BaseModelSpec

        spec = BaseModelSpec(name_or_path=self.model)
        tokenizer = load_tokenizer(spec)
        judge = SharedBase(load_causal_lm(spec, tokenizer))
        return judge.to(next(policy_base.parameters()).device), tokenizer

    def check_columns(self, columns: Sequence[str]) -> None:
        self.template.check_columns(columns)

    # ---- scoring ----------------------------------------------------------------------------------------

    def prompts(self, inputs: RewardInputs) -> list[str | Messages]:
        """The judge's prompt for each response of ``inputs``."""
        return [self.template.render(prompt, response, {name: values[row] for name, values in inputs.columns.items()})
                for row, (prompt, response) in enumerate(zip(inputs.prompts, inputs.completions, strict=True))]

    def verdicts(self, prompts: list[str | Messages]) -> tuple[list[float | None], list[str]]:
        """Each prompt's score (None = the answer could not be parsed) and the answer it was read from."""
        if self.parser == "logprob":
            if isinstance(self.judge, EndpointJudge):
                rows = self.judge.label_probabilities(prompts, list(self.labels))
            else:
                rows = self.judge.label_probabilities(prompts, self.label_ids).tolist()
            scores = [expected_score(row, list(self.labels.values())) for row in rows]
            answers = [f"label probabilities {dict(zip(self.labels, row, strict=True))}" for row in rows]
            return scores, answers
        answers = self.judge.answers(prompts)
        if self.parser == "number":
            return [parse_number(answer, self.low, self.high) for answer in answers], answers
        return [parse_label(answer, self.labels) for answer in answers], answers

    def score(self, inputs: RewardInputs) -> Tensor:
        scores, answers = self.verdicts(self.prompts(inputs))
        failed = [row for row, score in enumerate(scores) if score is None]
        self.last_failures = (len(failed), len(scores))
        if failed and not self.warned:
            self.warned = True
            expected = {"number": f"a number in [{self.low:g}, {self.high:g}]",
                        "labels": f"an answer starting with one of {list(self.labels)}",
                        "logprob": f"some probability on {list(self.labels)}"}[self.parser]
            rank_zero_warn(f"JudgeReward {self.name} ({self.describe}): could not parse the answer "
                           f"{answers[failed[0]]!r} to response {inputs.completions[failed[0]]!r} (expected "
                           f"{expected}); such rows score {self.failure:g} (failure_score), counted in "
                           f"objective/{self.name}/parse_failures (this warning is printed once)")
        values = [self.failure if score is None else score for score in scores]
        return torch.tensor(values, dtype=torch.float32, device=inputs.input_ids.device)

    def batch_metrics(self) -> dict[str, Tensor]:
        failures, rows = self.last_failures
        return {f"{self.name}/parse_failures": torch.tensor(float(failures)),
                f"{self.name}/parse_failure_rate": torch.tensor(failures / max(rows, 1))}
