"""The shared base as an lm-evaluation-harness model: any role of it (an adapter, or the base alone) answers lm-eval's
three requests, so that a task runs on the policy as it is, adapters on, without a second copy of the base.

:class:`SharedBaseLM` follows lm-eval's own Hugging Face model (``lm_eval.models.huggingface.HFLM``) request by
request: the same tokenization (a context's trailing spaces moved into the continuation, an empty context replaced by
the prefix token: BOS, else EOS), the same left truncation to the model's context, the same rolling windows for
perplexities, greedy generation unless a task asks to sample, cut at the first stop string. The numbers differ from
``HFLM``'s on the merged model by float rounding only (``tests/evaluation/test_harness_lm.py`` checks every request's
answer). What it does differently: the forward pass is the base's (:meth:`SharedBase.hidden_states`, positions counted
over real tokens), the LM head runs on the continuation's positions only, and log-probs are taken in float32.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import Tensor
from transformers import PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.engines import sampling_mode

DEFAULT_MAX_LENGTH = 2048  # lm-eval's, for a model whose config names no context length
CONTEXT_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx")  # lm-eval reads these, in this order
MAX_TOKEN_ALIASES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


def context_length(config: Any, tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokens a model attends to, as lm-eval resolves it: the (text) config's ``n_positions``,
    ``max_position_embeddings`` or ``n_ctx``, else the tokenizer's ``model_max_length``, else 2048."""
    config = getattr(config, "text_config", None) or config
    for field in CONTEXT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and limit < 10**9 else DEFAULT_MAX_LENGTH


class StopStrings(StoppingCriteria):
    """Ends a row of ``generate`` once its generated text (from column ``start``) holds one of ``stops``."""

    def __init__(self, stops: Sequence[str], tokenizer: PreTrainedTokenizerBase, start: int) -> None:
        self.stops, self.tokenizer, self.start = [stop for stop in stops if stop], tokenizer, start

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.start:])
        return torch.tensor([any(stop in text for stop in self.stops) for text in texts], device=input_ids.device)


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """``text`` up to its first stop string, each stop cut in turn (as lm-eval cuts a generation)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


def batches(order: list[int], size: int) -> Iterator[list[int]]:
    """``order`` in consecutive pieces of ``size``."""
    for start in range(0, len(order), size):
        yield order[start:start + size]


class SharedBaseLM(TemplateLM):
    """An lm-evaluation-harness model (``lm_eval.api.model.TemplateLM``) on a role of a shared base.

    Args:
        model: the shared base, with its adapters.
        tokenizer: the base's tokenizer (left padding).
        role: the adapter that answers (``policy``), or None for the base alone.
        batch_size: requests per forward pass (rows of ``generate``).
        max_length: tokens of context; null = the model's (see :func:`context_length`).
        max_gen_toks: tokens generated when a task does not say (lm-eval's default, 256).
    """

    def __init__(self, model: SharedBase, tokenizer: PreTrainedTokenizerBase, role: str | None = None,
                 batch_size: int = 8, max_length: int | None = None, max_gen_toks: int = 256) -> None:
        super().__init__()
        if batch_size < 1 or max_gen_toks < 1 or (max_length is not None and max_length < 2):
            raise ValueError(f"batch_size ({batch_size}) and max_gen_toks ({max_gen_toks}) must be >= 1 and "
                             f"max_length ({max_length}) >= 2")
        if role is not None and role not in model.adapters:
            raise ValueError(f"no adapter {role!r} to evaluate: the base has {model.adapters or 'none'}")
        self.shared, self.tokenizer, self.role = model, tokenizer, role
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.max_length = max_length or context_length(model.hf_model.config, tokenizer)

    @property
    def device(self) -> torch.device:
        return self.shared.hf_model.get_input_embeddings().weight.device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is replaced with: BOS, else EOS (as lm-eval's Hugging Face model)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``; the tokenizer's own special tokens unless told, none before a text that
        already starts with BOS (a chat template's output)."""
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            add_special_tokens = False
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **extra)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # ---- log-likelihoods ----------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """``(sum of the continuation's log-probs, whether greedy decoding gives it)`` per ``(key, context ids,
        continuation ids)``, longest first in batches; a row longer than the context loses its first tokens."""
        answers: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        with sampling_mode(self.shared, self.role, self.device), torch.no_grad():
            for chunk in batches(order, self.batch_size):
                rows = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in chunk]
                continuations = [requests[i][2] for i in chunk]
                for index, answer in zip(chunk, self._score_rows(rows, continuations), strict=True):
                    answers[index] = answer
        return answers

    def _score_rows(self, rows: list[list[int]], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):  # right padding: a row's real tokens keep positions 0..n-1
            ids[b, :len(row)], mask[b, :len(row)] = torch.tensor(row), 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        spans = [(len(row) - len(cont), len(row)) for row, cont in zip(rows, continuations, strict=True)]
        if self.shared.logit_transform is not None:
            hidden = self.shared.hidden_states(ids, mask)
            logits = self.shared.logits(torch.cat([hidden[b, start:end] for b, (start, end) in enumerate(spans)]))
        else:
            full = self.shared.full_logits(ids, mask)
            logits = torch.cat([full[b, start:end] for b, (start, end) in enumerate(spans)])
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor([token for cont in continuations for token in cont], device=logprobs.device)
        picked = logprobs.gather(-1, targets[:, None]).squeeze(-1)
        greedy = logprobs.argmax(-1) == targets
        answers, start = [], 0
        for cont in continuations:
            end = start + len(cont)
            answers.append((float(picked[start:end].sum()), bool(greedy[start:end].all())))
            start = end
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, in windows of the model's context that predict every token once
        (lm-eval's rolling windows, the first token conditioned on the prefix token)."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        return totals

    # ---- generation ---------------------------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, generated by the role (greedy unless ``do_sample: true``) up to
        ``max_gen_toks`` tokens or EOS, cut at its first stop string (``until``, EOS's text added)."""
        answers: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        for indices in groups.values():
            settings = dict(requests[indices[0]].args[1])
            lengths = {i: len(self.tok_encode(requests[i].args[0])) for i in indices}
            order = sorted(indices, key=lambda i: -lengths[i])
            for chunk in batches(order, self.batch_size):
                texts = self._generate([requests[i].args[0] for i in chunk], dict(settings))
                for index, text in zip(chunk, texts, strict=True):
                    answers[index] = text
        return answers

    def _generate(self, contexts: list[str], settings: dict[str, Any]) -> list[str]:
        until = settings.pop("until", None)
        stops = [until] if isinstance(until, str) else list(until or [])
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        if eos not in stops:
            stops.append(eos)
        given = [settings.pop(alias) for alias in MAX_TOKEN_ALIASES if alias in settings]
        max_new = int(given[0]) if given else self.max_gen_toks
        # As lm-eval's Hugging Face model: greedy unless a task or gen_kwargs says do_sample (a temperature alone
        # does not sample).
        do_sample = bool(settings.pop("do_sample", False))
        temperature = float(settings.pop("temperature", 0.0))
        if do_sample:
            settings["temperature"] = temperature if temperature > 0.0 else 1.0
        room = self.max_length - max_new
        if room < 1:
            raise ValueError(f"max_gen_toks {max_new} leaves no room for a context in the model's {self.max_length} "
                             "tokens")
        encoded = self.tokenizer(contexts, padding="longest", return_tensors="pt")
        ids = encoded["input_ids"][:, -room:].to(self.device)
        mask = encoded["attention_mask"][:, -room:].to(self.device)
        with sampling_mode(self.shared, self.role, self.device):
            output = self.shared.hf_model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=do_sample,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.eot_token_id, use_cache=True,
                stopping_criteria=StoppingCriteriaList([StopStrings(stops, self.tokenizer, ids.shape[1])]),
                synced_gpus=self.shared.is_sharded, **settings)
        return [cut_at_stops(self.tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True), stops)
                for row in output.tolist()]
