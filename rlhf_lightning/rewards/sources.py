"""Where the reward comes from: an adapter on the shared base, a separate model, or Python functions.

Each source is configured by ``class_path`` under the module's ``reward:`` argument (one source, or a list whose
scores are summed with ``reward_shaping.weights``, :mod:`rlhf_lightning.rewards.combine`); subclass
:class:`RewardSource` for anything else (a verifier, an ensemble, an API).
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.data.collate import pad
from rlhf_lightning.data.sources import DataFormatError
from rlhf_lightning.data.tokenize import encode_completion, encode_prompt
from rlhf_lightning.models.adapter_files import adapters_below
from rlhf_lightning.models.heads import ScalarHead
from rlhf_lightning.models.shared_base import SharedBase, position_ids_from_mask
from rlhf_lightning.rewards.inputs import RewardInputs

REWARD_ROLE = "reward"


def free_names(base: SharedBase, names: Sequence[str]) -> list[str]:
    """The adapter names a reward source loads its adapters under: ``names``, or, when another source of the run
    already holds one of them on the base, ``names`` with the first suffix ``_source2``, ``_source3``... that
    holds none (two sources under one name would both score with the adapter loaded last)."""
    taken = set(base.adapters) | set(base.heads)
    suffix, number = "", 1
    while any(name + suffix in taken for name in names):
        number += 1
        suffix = f"_source{number}"
    return [name + suffix for name in names]
REWARD_STATS = "reward_stats.json"


class RewardSource:
    """Scores a batch of responses. ``setup`` is called once with the policy's shared base and tokenizer.

    ``statistics`` is the ``(mean, std)`` of the source's scores on the reward stage's validation data, when
    known; ``reward_shaping.normalize`` uses it. ``name`` labels the source's metrics (``objective/score/<name>``).
    """

    statistics: tuple[float, float] | None = None
    may_abstain = True  # NaN means "not applicable to this response"; a reward model's NaN is a failure
    # A source that scores each step of a response (ProcessReward) has ``step_scores(inputs) -> (scores [B, R],
    # ends [B, R])`` and ``reduce(scores, ends) -> [B]``; PPO trains on the steps' scores at their last tokens.
    scores_steps = False
    # The adapter on the shared base that PPO's critic.from_reward copies (a reward adapter source's); None: none.
    adapter_role: str | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def setup(self, base: SharedBase, tokenizer: PreTrainedTokenizerBase) -> None:
        """Attach to the policy's base (adapter sources) or load own weights (separate models)."""

    def check_columns(self, columns: Sequence[str]) -> None:
        """Raise a one-line error, before any rollout, if the source cannot score rows with these dataset
        ``columns`` (a reward function's signature); nothing to check by default."""

    def check_values(self, rows: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Raise a one-line error, before any rollout, naming the row (``rows``: each row's file and line, and its
        columns) whose column values the source cannot score; nothing to check by default."""

    def score(self, inputs: RewardInputs) -> Tensor:
        """Scores ``[B]`` (float); NaN marks a response the source does not apply to."""
        raise NotImplementedError

    def batch_metrics(self) -> dict[str, Tensor]:
        """What the source counted in its latest :meth:`score` call (e.g. a judge's parse failures), logged by
        each training iteration as ``objective/<key>``; nothing by default."""
        return {}

    def response_values(self) -> dict[str, Tensor]:
        """Values ``[B]`` per response of the latest :meth:`score` call (an ensemble's disagreement), averaged over
        the held-out responses by validation as ``val/<key>`` (the online modules' ``validation_metrics`` name the
        keys they log); nothing by default."""
        return {}


def read_statistics(directory: Path) -> tuple[float, float] | None:
    """The ``(mean, std)`` of a reward model's scores that the reward stage wrote beside it; None without them."""
    path = directory / REWARD_STATS
    if not path.exists():
        return None
    stats = json.loads(path.read_text())
    return float(stats["mean"]), float(stats["std"])


class AdapterReward(RewardSource):
    """The reward stage's ``reward`` adapter and score head, loaded onto the policy's own base: the reward
    model costs no second copy of the weights. The adapter must have been trained on this same base (the SFT
    model).

    Args:
        path: folder of the adapter, as written by the reward stage (``outputs/reward/adapters/reward``).
    """

    may_abstain = False  # a reward model scores every response
    adapter_role = REWARD_ROLE

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.base: SharedBase | None = None

    def setup(self, base: SharedBase, tokenizer: PreTrainedTokenizerBase) -> None:
        config_path = self.path / "adapter_config.json"
        if not config_path.exists() and (self.path / "ensemble.json").exists():
            members = json.loads((self.path / "ensemble.json").read_text())["members"]
            raise FileNotFoundError(
                f"reward adapter: {self.path} holds an ensemble of {len(members)} reward models (ensemble.json), not "
                "one adapter: score with all of them, reward: {class_path: rlhf_lightning.EnsembleReward, init_args: "
                f"{{path: {self.path}}}}}, or name one member, e.g. {self.path / members[0]}")
        if not config_path.exists():
            below = adapters_below(self.path)
            if below:  # the path names a folder above the adapter
                raise FileNotFoundError(
                    f"reward adapter: {config_path} not found, but {', '.join(map(str, below))} "
                    f"hold{'s' if len(below) == 1 else ''} one: set reward.init_args.path to it")
            raise FileNotFoundError(
                f"reward adapter: {config_path} not found; run the reward stage first "
                "(python -m rlhf_lightning fit --config configs/reward.yaml) or set reward.init_args.path"
            )
        self.adapter_role = free_names(base, [REWARD_ROLE])[0]
        base.load_adapter(self.path, self.adapter_role, trainable=False)
        if self.adapter_role not in base.heads:
            raise FileNotFoundError(f"reward adapter: {self.path} has no score head (head.safetensors)")
        self.base = base
        self.statistics = read_statistics(self.path)

    @property
    def name(self) -> str:
        return "reward_model"

    def score(self, inputs: RewardInputs) -> Tensor:
        # a group's prompt is encoded once when the base shares prompts (the online modules' share_prompt); inputs
        # built without a response mask (the reward server's) do not say where the prompts end
        shared_until = None if inputs.response_mask is None else inputs.prompt_length
        return self.base.score(self.adapter_role, inputs.input_ids, inputs.attention_mask, inputs.last_index,
                               shared_until=shared_until)


class ModelReward(RewardSource):
    """A separate reward model with weights and a tokenizer of its own (policy and reward model may tokenize
    differently). It is held whole by every process (never sharded), on the device of the responses it scores.

    Each response is encoded for the reward model exactly as the reward stage encodes a completion with that
    tokenizer: a conversational prompt (the original messages) through the reward model's own chat template with
    the response as the assistant's message, a text prompt as text; closed with its turn-end token or EOS
    (:func:`~rlhf_lightning.data.tokenize.encode_completion`), where the score is read.

    Either a transformers sequence-classification model with one output (e.g. a hub reward model), or a folder
    written by the reward stage under full fine-tuning (a causal LM with ``head.safetensors``).

    Args:
        name_or_path: hub id or local folder.
        dtype: dtype of its weights.
        max_length: sequences are truncated from the left (the prompt's start) to this many tokens.
        chat_template: Jinja chat template for conversational prompts, instead of the reward tokenizer's own.
        trust_remote_code: run code shipped with a hub model.
    """

    may_abstain = False  # a reward model scores every response

    def __init__(self, name_or_path: str, dtype: str = "float32", max_length: int = 1024,
                 chat_template: str | None = None, trust_remote_code: bool = False) -> None:
        self.name_or_path = name_or_path
        self.dtype = getattr(torch, dtype)
        self.max_length = max_length
        self.chat_template = chat_template
        self.trust_remote_code = trust_remote_code

    def setup(self, base: SharedBase, tokenizer: PreTrainedTokenizerBase) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        from rlhf_lightning.models.loading import disable_dropout, ensure_pad_token

        kwargs = {"dtype": self.dtype, "trust_remote_code": self.trust_remote_code}
        self.tokenizer = AutoTokenizer.from_pretrained(self.name_or_path, trust_remote_code=self.trust_remote_code)
        if self.chat_template is not None:
            self.tokenizer.chat_template = self.chat_template
        if ScalarHead.exists(self.name_or_path):
            self.model = AutoModelForCausalLM.from_pretrained(self.name_or_path, **kwargs)
            self.head = ScalarHead.load(self.name_or_path, self.model.get_input_embeddings().embedding_dim)
        else:
            self.model = AutoModelForSequenceClassification.from_pretrained(self.name_or_path, num_labels=1,
                                                                            **kwargs)
            self.head = None
        if ensure_pad_token(self.tokenizer) and len(self.tokenizer) > self.model.get_input_embeddings().num_embeddings:
            # Padding is masked, but its id is still looked up in the embeddings.
            self.model.resize_token_embeddings(len(self.tokenizer))
        # Sequence-classification models pool at the last token that is not padding.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.requires_grad_(False).eval()
        disable_dropout(self.model)
        self.statistics = read_statistics(Path(self.name_or_path))

    def _to(self, device: torch.device) -> None:
        # Not a submodule of the LightningModule, so the strategy does not move it: it follows the rollout.
        if self.model.device != device:
            self.model.to(device)
            if self.head is not None:
                self.head.to(device)

    @property
    def name(self) -> str:
        return "reward_model"

    def encode(self, prompt: Any, completion: str, row: int) -> list[int]:
        """The reward model's token ids of ``prompt`` (text or messages) answered by ``completion``, ending with
        the token the score is read at, cut from the left to ``max_length``."""
        where = f"reward model {self.name_or_path}, row {row}"
        if isinstance(prompt, list):
            completion = [{"role": "assistant", "content": completion}]
        prompt_ids = encode_prompt(self.tokenizer, prompt, where)
        ids = prompt_ids + encode_completion(self.tokenizer, prompt, completion, prompt_ids, where)
        return ids[-self.max_length:]

    @torch.no_grad()
    def score(self, inputs: RewardInputs) -> Tensor:
        self._to(inputs.input_ids.device)
        sequences = [self.encode(prompt, completion, row)
                     for row, (prompt, completion) in enumerate(zip(inputs.prompts, inputs.completions, strict=True))]
        # Left padding: every sequence ends at the last column, where the score is read.
        input_ids, attention_mask = (t.to(self.model.device) for t in
                                     pad(sequences, self.tokenizer.pad_token_id, side="left"))
        batch = {"input_ids": input_ids, "attention_mask": attention_mask,
                 "position_ids": position_ids_from_mask(attention_mask)}
        if self.head is None:
            return self.model(**batch).logits[:, 0].float().to(inputs.input_ids.device)
        hidden = self.model.get_decoder()(**batch, use_cache=False).last_hidden_state
        return self.head(hidden[:, -1]).float().to(inputs.input_ids.device)


class FunctionReward(RewardSource):
    """A Python reward function with TRL's signature: ``fn(prompts, completions, completion_ids, **columns)``.

    It is called with keywords: ``prompts`` (as the dataset holds them: text or messages), ``completions`` (the
    decoded responses), ``completion_ids`` (their token ids) and every other column of the prompt dataset (one
    value per response), so accept ``**kwargs``. It returns one float per response, or ``None`` for "not
    applicable to this response": the row's reward is then the weighted sum of the other sources. A rule-based
    verifier, or the synthetic task's ``rlhf_lightning.tasks.synthetic.gold_rewards``. A function that reads a
    column in a form of its own may say how, as a ``column_readers`` attribute (``{column: read}``, ``read``
    raising ``ValueError`` on a value it cannot read): every row's value is read before any rollout, and a bad
    one stops the run naming the file, row and column (the tasks' checkers do so for ``answer``).

    Args:
        fn: the function, an import path in YAML, called as ``fn(prompts=..., completions=...,
            completion_ids=..., **columns) -> list[float | None]`` (one score per response, None = not
            applicable). Example: in ``my_rewards.py`` importable from where you run (the working folder or
            PYTHONPATH), ``def brevity(completions, **kwargs): return [-len(c) / 100 for c in completions]``,
            then ``reward: {class_path: rlhf_lightning.FunctionReward, init_args: {fn: my_rewards.brevity}}``.
    """

    def __init__(self, fn: Callable[..., Sequence[float | None]]) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionReward: fn must be a function, got {fn!r}")
        self.fn = fn

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    @property
    def label(self) -> str:
        """``module.name`` of the function, for messages."""
        return f"{getattr(self.fn, '__module__', '?')}.{self.name}"

    def check_columns(self, columns: Sequence[str]) -> None:
        """The function must take TRL's keywords and every column it asks for must be in the data."""
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a builtin or C function: nothing to inspect
            return
        given = ["prompts", "completions", "completion_ids", *columns]
        try:
            signature.bind(**{name: [] for name in given})
        except TypeError as error:
            parameters = signature.parameters
            takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
            unknown = [name for name in given if name not in parameters and not takes_kwargs]
            missing = [name for name, p in parameters.items() if p.default is p.empty
                       and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in given]
            if unknown and set(unknown) & {"prompts", "completions", "completion_ids"}:
                raise TypeError(
                    f"reward function {self.label}{signature} cannot take TRL's keywords: it is called as "
                    "fn(prompts=..., completions=..., completion_ids=..., **columns) and should accept **kwargs "
                    f"for the dataset's columns ({error})") from error
            if missing:
                raise ValueError(
                    f"reward function {self.label} needs column{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(repr, missing))}, which the prompt data lacks (its columns: "
                    f"{', '.join(columns) or 'only prompt'})") from error
            raise TypeError(f"reward function {self.label}{signature} cannot take the dataset's columns "
                            f"{', '.join(unknown)}: accept **kwargs ({error})") from error

    def check_values(self, rows: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Each row's value of every column the function reads through its ``column_readers`` (``{column: read}``,
        e.g. the tasks' ``answer``), read once before any rollout: a value ``read`` refuses stops the run with one
        line naming the row's file and line, the column and what was expected."""
        readers = getattr(self.fn, "column_readers", {})
        for where, columns in rows:
            for name, read in readers.items():
                if columns.get(name) is None:
                    continue
                try:
                    read(columns[name])
                except ValueError as error:
                    raise DataFormatError(f"{where}: column {name!r}: {error} (read by reward function "
                                          f"{self.label})") from None

    def score(self, inputs: RewardInputs) -> Tensor:
        where = f"reward function {getattr(self.fn, '__module__', '?')}.{self.name}"
        scores = self.fn(prompts=inputs.prompts, completions=inputs.completions,
                         completion_ids=inputs.completion_ids, **inputs.columns)
        scores = list(scores)
        if len(scores) != len(inputs.completions):
            raise ValueError(f"{where} returned {len(scores)} scores for {len(inputs.completions)} completions")
        values = []
        for row, score in enumerate(scores):
            if score is None:
                values.append(math.nan)
                continue
            if isinstance(score, Tensor) and score.numel() == 1:
                score = score.item()
            if isinstance(score, bool) or not isinstance(score, numbers.Real):
                raise TypeError(f"{where} returned {score!r} ({type(score).__name__}) for row {row} "
                                f"(completion {inputs.completions[row]!r}): expected a float or None")
            if not math.isfinite(score):
                raise ValueError(f"{where} returned {score} for row {row} (completion {inputs.completions[row]!r}): "
                                 "expected a finite float, or None for 'not applicable'")
            values.append(float(score))
        return torch.tensor(values, dtype=torch.float32, device=inputs.input_ids.device)
