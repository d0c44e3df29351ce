"""A judge that runs in the training process: a role of the policy's shared base, or a separate local causal LM.

Its answers are greedy (our own decoder, every token the argmax, from fixed uniform numbers) and its label
probabilities come from one forward pass: nothing is sampled, so neither consumes the training random streams
(:mod:`rlhf_lightning.rollout.seeds`) and a resumed run scores exactly as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.data.collate import pad
from rlhf_lightning.data.tokenize import completion_end_id, encode_prompt
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.ops.sampling import sampling_warpers
from rlhf_lightning.rollout.decode import Decoder
from rlhf_lightning.rollout.engines import sampling_mode

GREEDY = sampling_warpers(top_k=1)  # one token left per step: the inverse-CDF draw returns the argmax


class LocalJudge:
    """Answers judge prompts with ``role`` of ``base`` (None = adapters disabled: the reference, i.e. the SFT model).

    Args:
        base: the shared base (or a separate model wrapped in a :class:`SharedBase` of its own).
        role: the adapter that judges, or None.
        tokenizer: the base's tokenizer.
        max_new_tokens: tokens of an answer at most.
        max_length: a judge prompt is cut from the left to this many tokens (its end, where the response and the
            question usually are, is kept).
        batch_size: prompts per forward pass.
        label: what error messages call this judge.
    """

    def __init__(self, base: SharedBase, role: str | None, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                 max_length: int, batch_size: int, label: str) -> None:
        self.base, self.role, self.tokenizer = base, role, tokenizer
        self.max_new_tokens, self.max_length, self.batch_size, self.label = (max_new_tokens, max_length, batch_size,
                                                                             label)
        self.decoder = Decoder(base.hf_model, compiled=False)
        self.stop_ids = sorted({tokenizer.eos_token_id, completion_end_id(tokenizer, conversational=True)})

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    def label_token(self, label: str) -> int:
        """The one token of ``label`` (as written, e.g. ``" yes"``); one line when it is not a single known token."""
        ids = self.tokenizer(label, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or ids[0] == self.tokenizer.unk_token_id:
            raise ValueError(f"JudgeReward labels: {label!r} is {len(ids)} token(s) {ids} under the judge's tokenizer "
                             f"({self.label}); parser logprob reads one known token per label (mind a leading space)")
        return ids[0]

    def encode(self, prompts: list[str | list[dict[str, str]]]) -> tuple[Tensor, Tensor]:
        """Left-padded token ids and mask of judge prompts, each cut from the left to ``max_length``."""
        rows = [encode_prompt(self.tokenizer, prompt, f"{self.label}, judge prompt {row}")[-self.max_length:]
                for row, prompt in enumerate(prompts)]
        ids, mask = pad(rows, self.tokenizer.pad_token_id, side="left")
        return ids.to(self.device), mask.to(self.device)

    def chunks(self, prompts: list[Any]) -> list[list[Any]]:
        return [prompts[i:i + self.batch_size] for i in range(0, len(prompts), self.batch_size)]

    @torch.no_grad()
    def answers(self, prompts: list[str | list[dict[str, str]]]) -> list[str]:
        """The judge's greedy answer to each prompt, as text (special tokens dropped)."""
        texts = []
        for chunk in self.chunks(prompts):
            ids, mask = self.encode(chunk)
            fixed = torch.full((ids.shape[0], self.max_new_tokens), 0.5, dtype=torch.float64, device=ids.device)
            stop_ids = torch.tensor(self.stop_ids, device=ids.device)
            with sampling_mode(self.base, self.role, ids.device):
                tokens, _ = self.decoder(ids, mask, GREEDY, self.max_new_tokens, stop_ids,
                                         self.tokenizer.pad_token_id, draws=fixed, synced=self.base.is_sharded)
            for row in tokens.tolist():
                ends = [i for i, token in enumerate(row) if token in self.stop_ids]
                texts.append(self.tokenizer.decode(row[:ends[0]] if ends else row, skip_special_tokens=True))
        return texts

    @torch.no_grad()
    def label_probabilities(self, prompts: list[str | list[dict[str, str]]], label_ids: list[int]) -> Tensor:
        """``[B, L]`` probabilities of each label token as the judge's next token, from one forward pass."""
        columns = []
        for chunk in self.chunks(prompts):
            ids, mask = self.encode(chunk)
            with sampling_mode(self.base, self.role, ids.device):
                logits = self.base.full_logits(ids, mask, logits_to_keep=1)[:, -1].float()
            columns.append(logits.softmax(-1)[:, label_ids])
        return torch.cat(columns)
