"""A process reward model as a reward source: one score per step of each sampled response.

The PRM stage's adapter (:class:`~rlhf_lightning.stages.process_reward_model.ProcessRewardModel`) is loaded onto the policy's own base, as
:class:`~rlhf_lightning.rewards.sources.AdapterReward` is. A response's steps end at its separator tokens, and its
last step at its last token; each step's score is the PRM's probability that the step is right, read at the
separator after it, exactly as the PRM was trained (the last step is read at a separator put after it, in place of
the stop token).

PPO places each step's score at its step's last token (a dense reward, with GAE); the critic-free algorithms train
on one number per response, the ``reduction`` of its step scores.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Literal, get_args

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.data.collate import pad
from rlhf_lightning.data.tokenize import separator_token_id
from rlhf_lightning.models.adapter_files import adapters_below
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.rewards.sources import RewardSource
from rlhf_lightning.utils import checks

PRM_ROLE = "prm"
PRM_CONFIG = "prm_config.json"  # the separator, beside the exported adapter

Reduction = Literal["min", "last", "mean", "prod"]


def step_ends(responses: Tensor, response_mask: Tensor, separator_id: int, stop_ids: Tensor) -> Tensor:
    """``[B, R]`` bool: the last token of every step of each response: each separator token, and the response's
    last token when a step follows the last separator (tokens other than a stop token) or the response has no
    separator at all (its whole text is one step).

    ``responses``/``response_mask`` ``[B, R]``: the tokens and which of them are the response's (a prefix of each
    row); ``stop_ids``: the ids that end a response (EOS, stop tokens).
    """
    separators = (responses == separator_id) & response_mask
    positions = torch.arange(responses.shape[1], device=responses.device)
    last = torch.where(response_mask, positions, -1).max(-1).values  # [B], -1 for an empty response
    last_separator = torch.where(separators, positions, -1).max(-1).values
    last_token = responses.gather(1, last.clamp(min=0)[:, None])[:, 0]
    body_end = last - torch.isin(last_token, stop_ids).long()  # the last token that is not a stop token
    open_step = (body_end > last_separator) | (last_separator < 0)
    ends = separators.clone()
    rows = (open_step & (last >= 0)).nonzero().flatten()
    ends[rows, last[rows]] = True
    return ends


def reduce_steps(scores: Tensor, ends: Tensor, reduction: Reduction) -> Tensor:
    """``[B]`` one number per response from its step scores ``[B, R]`` at ``ends``: their ``min`` (Math-Shepherd,
    Wang et al. 2024), ``prod`` (Lightman et al. 2023, the probability that every step is right), ``mean``, or the
    ``last`` one. A row without steps (no response tokens) gets 0."""
    if reduction == "min":
        reduced = torch.where(ends, scores, torch.inf).amin(-1)
    elif reduction == "prod":
        reduced = torch.where(ends, scores, 1.0).prod(-1)
    elif reduction == "mean":
        reduced = torch.where(ends, scores, 0.0).sum(-1) / ends.sum(-1).clamp(min=1)
    else:
        positions = torch.arange(ends.shape[1], device=ends.device)
        last = torch.where(ends, positions, -1).max(-1).values.clamp(min=0)
        reduced = scores.gather(1, last[:, None])[:, 0]
    return torch.where(ends.any(-1), reduced, 0.0)


class ProcessReward(RewardSource):
    """A process reward model (the PRM stage's ``prm`` adapter and head) scoring each step of a response, loaded
    onto the policy's own base: no second copy of the weights. The adapter must have been trained on this same base.

    A step's score is the PRM's probability that it is right, in [0, 1]. PPO trains on every step's score at its
    step's last token (a dense reward); GRPO, RLOO, REINFORCE++ and validation use their ``reduction``. Scores of
    single-turn responses only (not episodes with an environment).

    Args:
        path: folder of the adapter, as the PRM stage writes it (``outputs/arithmetic/prm/adapters/prm``).
        reduction: one score per response from its steps' scores: ``min`` (a chain is as good as its worst step;
            Math-Shepherd), ``prod`` (the probability that every step is right; Lightman et al. 2023), ``mean``,
            or ``last`` (the final step's).
    """

    may_abstain = False  # a PRM scores every response
    scores_steps = True

    def __init__(self, path: str, reduction: Reduction = "min") -> None:
        checks.one_of("reduction", reduction, get_args(Reduction))
        self.path = Path(path)
        self.reduction = reduction
        self.base: SharedBase | None = None
        self.separator_id: int | None = None
        self.pad_id = 0
        self.end_ids: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return "process_reward"

    def setup(self, base: SharedBase, tokenizer: PreTrainedTokenizerBase) -> None:
        config_path = self.path / PRM_CONFIG
        below = [] if config_path.exists() else adapters_below(self.path, PRM_CONFIG)
        if below:  # the path names a folder above the adapter
            raise FileNotFoundError(f"process reward: {config_path} not found, but {', '.join(map(str, below))} "
                                    f"hold{'s' if len(below) == 1 else ''} one: set reward.init_args.path to it")
        if not config_path.exists():
            raise FileNotFoundError(
                f"process reward: {config_path} not found; run the PRM stage first (python -m rlhf_lightning fit "
                "--config configs/arithmetic_prm.yaml) or set reward.init_args.path to its adapters/prm folder")
        config = json.loads(config_path.read_text())
        self.separator_id = separator_token_id(tokenizer, config["separator"], f"process reward {self.path}: separator")
        if self.separator_id != config["separator_id"]:
            raise ValueError(f"process reward {self.path}: separator {config['separator']!r} is token "
                             f"{self.separator_id} under the policy's tokenizer, token {config['separator_id']} under "
                             "the PRM's: train the PRM on the policy's base")
        base.load_adapter(self.path, PRM_ROLE, trainable=False)
        if PRM_ROLE not in base.heads:
            raise FileNotFoundError(f"process reward: {self.path} has no step head (head.safetensors)")
        self.base = base
        self.pad_id = tokenizer.pad_token_id
        self.end_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)

    def step_scores(self, inputs: RewardInputs) -> tuple[Tensor, Tensor]:
        """``(scores [B, R], ends [B, R])``: each step's probability of being right at its last token (0 elsewhere),
        and where the steps end (:func:`step_ends`)."""
        mask = inputs.response_mask
        responses, prompt_length = inputs.responses, inputs.prompt_length
        stop_ids = torch.tensor([*self.end_ids, *inputs.stop_token_ids], dtype=responses.dtype,
                                device=responses.device)
        ends = step_ends(responses, mask, self.separator_id, stop_ids)
        if mask.any() and not bool(((responses == self.separator_id) & mask).any()):
            # Every response one step: the PRM scores whole responses, as it was never trained to (warned once).
            warnings.warn(f"process reward {self.path}: no response of the batch contains the step separator "
                          f"(token {self.separator_id}), so each is scored as one step; does the policy write steps "
                          "the way the PRM's training data did?", UserWarning, stacklevel=2)
        stop_list = stop_ids.tolist()
        sequences, read_positions = [], []
        for row in range(mask.shape[0]):
            length = int(mask[row].sum())
            if not bool(mask[row, :length].all()):
                raise ValueError(f"process reward: row {row}'s response is not one run of tokens (an episode?); "
                                 "ProcessReward scores single-turn responses")
            prompt = inputs.input_ids[row, :prompt_length][inputs.attention_mask[row, :prompt_length].bool()]
            step_positions = ends[row].nonzero().flatten().tolist()
            body = responses[row, :length].tolist()
            reads = [len(prompt) + position for position in step_positions]
            if step_positions and body[step_positions[-1]] != self.separator_id:
                # The last step is read at a separator put after it (in place of its stop token), as trained.
                last = step_positions[-1]
                keep = int(body[last] not in stop_list)
                body = body[:last + keep] + [self.separator_id]
                reads[-1] = len(prompt) + last + keep
            sequences.append(prompt.tolist() + body)
            read_positions.append(reads)
        ids, attention = (t.to(responses.device) for t in pad(sequences, self.pad_id, side="left"))
        with torch.no_grad(), self.base.role(PRM_ROLE):
            logits = self.base.heads[PRM_ROLE](self.base.hidden_states(ids, attention))
        scores = torch.zeros(mask.shape, dtype=torch.float32, device=responses.device)
        for row, positions in enumerate(read_positions):
            offset = ids.shape[1] - len(sequences[row])  # left padding
            read = torch.tensor(positions, dtype=torch.long, device=ids.device) + offset
            scores[row, ends[row]] = torch.sigmoid(logits[row, read].float())
        return scores, ends

    def reduce(self, scores: Tensor, ends: Tensor) -> Tensor:
        """``[B]`` each response's ``reduction`` of its step scores."""
        return reduce_steps(scores, ends, self.reduction)

    def score(self, inputs: RewardInputs) -> Tensor:
        return self.reduce(*self.step_scores(inputs))
