"""Where PPO's reward comes from: an adapter on the shared base, a separate model, or a Python function.

Each source is configured by ``class_path`` under the PPO module's ``reward:`` argument; subclass
:class:`RewardSource` for anything else (a verifier, an ensemble, an API).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.models.heads import ScalarHead
from rlhf_lightning.models.shared_base import SharedBase

log = logging.getLogger(__name__)

REWARD_ROLE = "reward"
REWARD_STATS = "reward_stats.json"


class RewardSource:
    """Scores a batch of responses. ``setup`` is called once with the policy's shared base and tokenizer.

    ``statistics`` is the ``(mean, std)`` of the source's scores on the reward stage's validation data, when
    known; PPO's ``reward_normalize`` uses it.
    """

    statistics: tuple[float, float] | None = None

    def setup(self, base: SharedBase, tokenizer: PreTrainedTokenizerBase) -> None:
        """Attach to the policy's base (adapter sources) or load own weights (separate models)."""

    def score(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        last_index: Tensor,
        prompts: Sequence[str],
        responses: Sequence[str],
    ) -> Tensor:
        """Scores ``[B]`` of the sequences ``input_ids`` (prompt + response tokens, read at ``last_index``), also
        given as texts."""
        raise NotImplementedError


def _read_statistics(directory: Path) -> tuple[float, float] | None:
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

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.base: SharedBase | None = None

    def setup(self, base: SharedBase, tokenizer: PreTrainedTokenizerBase) -> None:
        config_path = self.path / "adapter_config.json"
        if not config_path.exists():
            raise FileNotFoundError(
                f"reward adapter: {config_path} not found; run the reward stage first "
                "(python -m rlhf_lightning fit --config configs/reward.yaml) or set reward.init_args.path"
            )
        trained_on = json.loads(config_path.read_text()).get("base_model_name_or_path")
        loaded = base.hf_model.config.name_or_path
        if trained_on and loaded and Path(trained_on).resolve() != Path(loaded).resolve():
            log.warning("the reward adapter in %s was trained on %s, but the PPO base is %s: they must hold the "
                        "same weights", self.path, trained_on, loaded)
        base.load_adapter(self.path, REWARD_ROLE, trainable=False)
        if REWARD_ROLE not in base.heads:
            raise FileNotFoundError(f"reward adapter: {self.path} has no score head (head.safetensors)")
        self.base = base
        self.statistics = _read_statistics(self.path)

    def score(self, input_ids, attention_mask, last_index, prompts, responses) -> Tensor:
        return self.base.score(REWARD_ROLE, input_ids, attention_mask, last_index)


class ModelReward(RewardSource):
    """A separate reward model with weights of its own, scoring the decoded texts (prompt and response
    together, special tokens dropped) with its own tokenizer.

    Either a transformers sequence-classification model with one output (e.g. a hub reward model), or a folder
    written by the reward stage under full fine-tuning (a causal LM with ``head.safetensors``).

    Args:
        name_or_path: hub id or local folder.
        dtype: dtype of its weights.
        max_length: texts are truncated (from the left) to this many tokens.
        trust_remote_code: run code shipped with a hub model.
    """

    def __init__(
        self, name_or_path: str, dtype: str = "float32", max_length: int = 1024, trust_remote_code: bool = False
    ) -> None:
        self.name_or_path = name_or_path
        self.dtype = getattr(torch, dtype)
        self.max_length = max_length
        self.trust_remote_code = trust_remote_code

    def setup(self, base: SharedBase, tokenizer: PreTrainedTokenizerBase) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        from rlhf_lightning.models.loading import disable_dropout, ensure_pad_token

        self.policy_tokenizer = tokenizer
        kwargs = {"dtype": self.dtype, "trust_remote_code": self.trust_remote_code}
        self.tokenizer = AutoTokenizer.from_pretrained(self.name_or_path, trust_remote_code=self.trust_remote_code)
        ensure_pad_token(self.tokenizer)
        self.tokenizer.padding_side = self.tokenizer.truncation_side = "left"
        if ScalarHead.exists(self.name_or_path):
            self.model = AutoModelForCausalLM.from_pretrained(self.name_or_path, **kwargs)
            self.head = ScalarHead.load(self.name_or_path, self.model.get_input_embeddings().embedding_dim)
        else:
            self.model = AutoModelForSequenceClassification.from_pretrained(self.name_or_path, num_labels=1,
                                                                            **kwargs)
            self.head = None
        self.model.requires_grad_(False).eval()
        disable_dropout(self.model)
        device = base.hf_model.device
        self.model.to(device)
        if self.head is not None:
            self.head.to(device)
        self.statistics = _read_statistics(Path(self.name_or_path))

    @torch.no_grad()
    def score(self, input_ids, attention_mask, last_index, prompts, responses) -> Tensor:
        texts = [self.policy_tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                 for ids, mask in zip(input_ids, attention_mask, strict=True)]
        # Left padding: every sequence ends at the last column, where the score is read.
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                               max_length=self.max_length).to(self.model.device)
        if self.head is None:
            return self.model(**batch).logits[:, 0].float().to(input_ids.device)
        position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        hidden = self.model.get_decoder()(**batch, position_ids=position_ids).last_hidden_state
        return self.head(hidden[:, -1]).to(input_ids.device)


class FunctionReward(RewardSource):
    """A Python function ``fn(prompts, responses) -> scores``, e.g. a rule-based verifier, or the synthetic
    task's ``rlhf_lightning.tasks.synthetic.gold_rewards`` to optimise the true reward directly.

    Args:
        fn: the function (an import path in YAML).
    """

    def __init__(self, fn: Callable[[Sequence[str], Sequence[str]], Sequence[float]]) -> None:
        self.fn = fn

    def score(self, input_ids, attention_mask, last_index, prompts, responses) -> Tensor:
        scores = list(self.fn(list(prompts), list(responses)))
        if len(scores) != len(responses):
            raise ValueError(f"reward function {self.fn} returned {len(scores)} scores for {len(responses)} responses")
        return torch.tensor(scores, dtype=torch.float32, device=input_ids.device)
