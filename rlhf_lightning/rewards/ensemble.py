"""An ensemble of reward models on the policy's own base: K reward adapters and their heads beside the base already
in memory, their scores combined by the mean, the worst case or the mean less their variance (Coste et al. 2023)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.algorithms.ensemble import COMBINE_RULES, CombineRule, combine_members, member_variance
from rlhf_lightning.models.adapter_files import adapters_below
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.rewards.sources import REWARD_ROLE, RewardSource, free_names, read_statistics
from rlhf_lightning.utils import checks

ENSEMBLE_FILE = "ensemble.json"  # written by the reward stage beside an ensemble's members


def member_folders(path: str | list[str]) -> list[Path]:
    """The members' adapter folders: an ensemble the reward stage exported (a folder with ``ensemble.json``), a
    list of single reward adapters' folders (members from separate fits), or one adapter (an ensemble of one)."""
    if isinstance(path, list | tuple):
        if not path:
            raise ValueError("EnsembleReward: path is an empty list; give the members' adapter folders")
        folders = [Path(p) for p in path]
    else:
        folder = Path(path)
        manifest = folder / ENSEMBLE_FILE
        if manifest.exists():
            folders = [folder / name for name in json.loads(manifest.read_text())["members"]]
        elif (folder / "adapter_config.json").exists():
            folders = [folder]
        else:
            below = adapters_below(folder)
            hint = f"; it holds adapters at {', '.join(map(str, below))}: list them as path" if below else \
                "; train one with the reward stage and members: K (configs/reward.yaml)"
            raise FileNotFoundError(f"EnsembleReward: {folder} holds no ensemble ({ENSEMBLE_FILE}) nor an "
                                    f"adapter (adapter_config.json){hint}")
    missing = [str(f) for f in folders if not (f / "adapter_config.json").exists()]
    if missing:
        raise FileNotFoundError(f"EnsembleReward: no reward adapter at {', '.join(missing)} (adapter_config.json)")
    return folders


class EnsembleReward(RewardSource):
    """Reward-model ensemble (Coste et al. 2023, "Reward Model Ensembles Help Mitigate Overoptimization"): K reward
    adapters and score heads loaded onto the policy's own base, so the ensemble costs K adapters and K scoring
    passes, never K bases. Each response is scored by every member; the scores are standardised per member (each
    by its own validation mean and std: a Bradley-Terry model is only defined up to a shift, and has its own
    scale) and combined:

    - ``mean``: the members' average (mean optimisation);
    - ``min``: the lowest member's score (worst-case optimisation, WCO);
    - ``uwo``: the mean less ``uncertainty_coef`` times the members' variance (uncertainty-weighted optimisation).

    Every training iteration logs ``objective/reward_disagreement`` (the members' standard deviation per response,
    averaged) and each member's mean score (``objective/reward_member_<k>``); validation logs
    ``val/reward_disagreement``: where it grows, the policy is leaving what the reward models agree on.

    Args:
        path: the reward stage's ensemble (``outputs/reward/adapters/reward``, written with ``members: K``), or a
            list of single reward adapters' folders (members trained in separate fits, e.g. other seeds), or one
            adapter (an ensemble of one). Every member must have been trained on this same base.
        combine: ``mean``, ``min`` (WCO) or ``uwo``.
        uncertainty_coef: UWO's lambda, the weight of the members' variance (of standardised scores); only
            ``combine: uwo`` reads it.
        standardize: standardise each member's scores with its ``reward_stats.json`` before combining; off = the
            raw scores (then ``min`` and ``uwo`` compare members on scales of their own).
    """

    may_abstain = False  # a reward model scores every response

    def __init__(self, path: str | list[str], combine: CombineRule = "min", uncertainty_coef: float = 0.5,
                 standardize: bool = True) -> None:
        checks.one_of("combine", combine, COMBINE_RULES)
        checks.non_negative("uncertainty_coef", uncertainty_coef)
        self.path = path
        self.combine = combine
        self.uncertainty_coef = uncertainty_coef
        self.standardize = standardize
        self.base: SharedBase | None = None
        self.roles: list[str] = []
        self._last: Tensor | None = None  # the latest scores of every member [B, K], standardised

    @property
    def name(self) -> str:
        return "reward_ensemble"

    @property
    def adapter_role(self) -> str | None:
        """The first member's adapter: what PPO's ``critic.from_reward`` copies."""
        return self.roles[0] if self.roles else f"{REWARD_ROLE}_0"

    def setup(self, base: SharedBase, tokenizer: PreTrainedTokenizerBase) -> None:
        folders = member_folders(self.path)
        self.roles = free_names(base, [f"{REWARD_ROLE}_{k}" for k in range(len(folders))])
        statistics = []
        for folder, role in zip(folders, self.roles, strict=True):
            base.load_adapter(folder, role, trainable=False)
            if role not in base.heads:
                raise FileNotFoundError(f"EnsembleReward: {folder} has no score head (head.safetensors)")
            statistics.append(read_statistics(folder))
        if self.standardize and None in statistics:
            lacking = [str(f) for f, s in zip(folders, statistics, strict=True) if s is None]
            raise FileNotFoundError(f"EnsembleReward: standardize needs each member's reward_stats.json, which "
                                    f"{', '.join(lacking)} lack (written by the reward stage); or set standardize: false")
        self.member_statistics = statistics
        self.base = base
        # Standardised members combine to scores of about that scale: reward_shaping.normalize leaves them alone.
        self.statistics = (0.0, 1.0) if self.standardize else None

    def member_scores(self, inputs: RewardInputs) -> Tensor:
        """Every member's score ``[B, K]`` (standardised with ``standardize``)."""
        shared_until = None if inputs.response_mask is None else inputs.prompt_length
        scores = torch.stack([self.base.score(role, inputs.input_ids, inputs.attention_mask, inputs.last_index,
                                              shared_until=shared_until) for role in self.roles], -1)
        if self.standardize:
            mean = scores.new_tensor([s[0] for s in self.member_statistics])
            std = scores.new_tensor([max(s[1], 1e-8) for s in self.member_statistics])
            scores = (scores - mean) / std
        return scores

    def score(self, inputs: RewardInputs) -> Tensor:
        self._last = self.member_scores(inputs)
        return combine_members(self._last, self.combine, self.uncertainty_coef)

    def response_values(self) -> dict[str, Tensor]:
        """The members' standard deviation per response of the latest :meth:`score` call: ``reward_disagreement``."""
        return {} if self._last is None else {"reward_disagreement": member_variance(self._last).sqrt()}

    def batch_metrics(self) -> dict[str, Tensor]:
        if self._last is None:
            return {}
        metrics = {"reward_disagreement": member_variance(self._last).sqrt().mean()}
        metrics.update({f"reward_member_{k}": column.mean() for k, column in enumerate(self._last.unbind(-1))})
        return metrics
