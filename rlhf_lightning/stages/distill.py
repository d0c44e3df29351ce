"""On-policy distillation: the student samples, the teacher grades every token.

Each response token's reward is log p_teacher(y_t | y_<t) - log p_student(y_t | y_<t) on the student's own
samples: its sum over a response is minus the reverse KL from the student to the teacher, estimated where the
student actually goes (on-policy distillation as in GKD, Agarwal et al. 2024, with on-policy data; Thinking
Machines' "On-Policy Distillation", 2025; NeMo-RL). The advantage of a token is its own reward (no discount, no
baseline: the teacher's judgement is per token already), trained with the registered policy loss (``policy_loss``:
PPO's clipped surrogate by default, with its importance ratios to the sampling policy). It runs with
any number of samples per prompt (no group) and on episodes (the teacher reads the whole transcript; only the
policy's tokens are graded).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.algorithms.kl import KLPenalty
from rlhf_lightning.algorithms.losses import logprobs_from_logits
from rlhf_lightning.algorithms.masked import masked_mean
from rlhf_lightning.algorithms.shaped_rewards import ShapedRewards
from rlhf_lightning.core.collect import Stats
from rlhf_lightning.core.experience import Experience
from rlhf_lightning.core.policy_gradient import PolicyGradient
from rlhf_lightning.models.shared_base import SharedBase, position_ids_from_mask
from rlhf_lightning.utils.timing import phase

TEACHER = "teacher"  # the teacher's role on the shared base, when it is an adapter


@dataclass(frozen=True)
class DistillationExperience(Experience):
    """The loop's experience with the teacher's log-probs of the policy's tokens."""

    teacher_logprobs: Tensor | None = None  # [B, R], 0 off the policy's tokens


class OnPolicyDistillation(PolicyGradient):
    """Distil a teacher into the policy adapter on the student's own samples (reverse KL per token).

    Args:
        teacher: folder of the teacher: a LoRA adapter trained on this same base (e.g. a GRPO run's exported
            ``adapters/policy``), loaded frozen onto the shared base as the ``teacher`` role, so the teacher costs no
            second copy of the weights; or a transformers causal LM with the student's vocabulary (e.g. a policy
            merged with ``python -m rlhf_lightning merge``), loaded frozen, in ``teacher_dtype``.
        teacher_dtype: dtype of the teacher's weights (a separate model only).
        reward_coef: weight of the reward sources' score added to every token's advantage (0 = pure
            distillation; the scores are logged either way).
        kl: the KL penalty to the reference (``default_kl``: coefficient 0, the teacher anchors the policy).
        samples_per_prompt: responses per prompt (1 is enough: no group baseline).
    """

    metric_prefix = "distill"
    default_kl = KLPenalty(coef=0.0)

    def __init__(self, *args: Any, teacher: str, teacher_dtype: str = "float32", reward_coef: float = 0.0,
                 kl: KLPenalty = default_kl, samples_per_prompt: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, kl=kl, samples_per_prompt=samples_per_prompt, **kwargs)
        if not hasattr(torch, teacher_dtype) or not isinstance(getattr(torch, teacher_dtype), torch.dtype):
            raise ValueError(f"teacher_dtype {teacher_dtype!r} is not a torch dtype (float32, bfloat16, float16)")
        self._teacher: list[torch.nn.Module] = []  # not a submodule: not checkpointed, not trained, not moved

    @property
    def teacher_is_adapter(self) -> bool:
        """Whether the teacher is an adapter on the shared base (else a separate model)."""
        return (Path(self.hparams.teacher) / "adapter_config.json").is_file()

    def build_model(self, empty: bool) -> SharedBase:
        model = super().build_model(empty)
        if self.teacher_is_adapter:
            model.load_adapter(self.hparams.teacher, TEACHER, trainable=False)
        else:
            self._teacher[:] = [self.load_teacher()]
        return model

    def load_teacher(self) -> torch.nn.Module:
        """The frozen teacher, after checking that it speaks the student's vocabulary."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_lightning.models.loading import disable_dropout

        folder = Path(self.hparams.teacher)
        if not (folder / "config.json").is_file():
            raise ValueError(f"teacher {self.hparams.teacher}: neither adapter_config.json nor config.json there; "
                             "give the folder of a LoRA adapter trained on this base (a run's adapters/policy) or of "
                             "a transformers causal LM (python -m rlhf_lightning merge writes one)")
        theirs = AutoTokenizer.from_pretrained(folder).get_vocab() if (folder / "tokenizer_config.json").is_file() \
            else None
        if theirs is not None and theirs != self.tokenizer.get_vocab():
            missing = len(set(self.tokenizer.get_vocab().items()) - set(theirs.items()))
            raise ValueError(f"teacher {self.hparams.teacher}: its tokenizer has another vocabulary ({len(theirs)} "
                             f"tokens, {missing} of the student's {len(self.tokenizer)} differ or are missing); "
                             "distillation by log-probs needs the student's vocabulary")
        teacher = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, self.hparams.teacher_dtype))
        if teacher.get_output_embeddings().weight.shape[0] < len(self.tokenizer):
            raise ValueError(f"teacher {self.hparams.teacher}: its output layer has "
                             f"{teacher.get_output_embeddings().weight.shape[0]} tokens, fewer than the student's "
                             f"{len(self.tokenizer)}")
        teacher.requires_grad_(False).eval()
        disable_dropout(teacher)
        return teacher

    @torch.no_grad()
    def teacher_logprobs(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
        """``[B, R]`` the teacher's log-probs of the response tokens (the last ``R`` columns), at the sampling
        temperature (the student's are taken at it too)."""
        if self.teacher_is_adapter:
            logprobs, _ = self.policy.response_logprobs(TEACHER, input_ids, attention_mask, response_mask)
            return torch.where(response_mask, logprobs, 0.0)
        teacher = self._teacher[0]
        if teacher.device != input_ids.device:
            teacher.to(input_ids.device)
        width = response_mask.shape[1]
        # Only the positions that predict response tokens: never the whole [B, T, V] logits.
        logits = teacher(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids_from_mask(attention_mask), logits_to_keep=width + 1).logits
        logits = logits[:, :-1, : len(self.tokenizer)].float() / self.sampling.temperature
        return torch.where(response_mask, logprobs_from_logits(logits, input_ids[:, -width:]), 0.0)

    @torch.no_grad()
    def extend_experience(self, experience: Experience) -> DistillationExperience:
        """The teacher's log-probs of the policy's tokens."""
        with phase("rollout/teacher"):
            teacher = self.teacher_logprobs(experience.input_ids, experience.attention_mask,
                                            experience.response_mask)
        return experience.extended(DistillationExperience, teacher_logprobs=teacher)

    def estimate_advantages(self, experience: DistillationExperience, rewards: ShapedRewards
                            ) -> tuple[Experience, Stats]:
        """A_t = log p_teacher(y_t) - log p_student(y_t) (+ ``reward_coef`` x score), 0 off the policy's tokens;
        the student's log-probs are the sampler's own (those the tokens were drawn with)."""
        mask = experience.response_mask
        reward = torch.where(mask, experience.teacher_logprobs - experience.sampler_logprobs, 0.0)
        advantages = reward + self.hparams.reward_coef * rewards.total_scores[:, None]
        if rewards.kl_coef:  # the KL to the reference in the rewards, per token (kl.added_to: reward)
            advantages = advantages - rewards.kl_coef * rewards.kl
        advantages = torch.where(mask, advantages, 0.0)
        reverse_kl = -reward.sum(-1)
        stats = {"teacher/reverse_kl": reverse_kl.mean(),
                 "teacher/reverse_kl_per_token": masked_mean(-reward, mask),
                 "teacher/logprob": masked_mean(experience.teacher_logprobs, mask)}
        return dataclasses.replace(experience, advantages=advantages), stats
