"""PPO for language models with one frozen base shared by the policy, reference, critic and reward model.

One ``training_step`` is one PPO iteration on a batch of prompts, readable top to bottom:

1. rollout (eval mode, no grad): sample responses from the policy adapter, cut them after the stop token, then
   score them once: old log-probs, reference log-probs, values, reward (when the first update micro-batch is the
   whole rollout, its own forward pass gives the old log-probs, and values too with a joint backward: the policy
   has not changed yet, so the numbers are the same and a scoring pass is saved);
2. per-token rewards (``-kl_coef * KL_t`` on every token, the score at the last one), GAE, returns, whitening;
3. ``ppo_epochs`` passes over shuffled minibatches: clipped policy loss + clipped value loss (- entropy bonus,
   + pretraining loss), backward (one for both losses, or policy then critic so that their graphs are never held
   together), gradient clipping, optimizer step.

The math lives in :mod:`rlhf_lightning.algorithms`; the methods below only orchestrate it. Subclasses change
the algorithm by overriding :meth:`shape_rewards`, :meth:`estimate_advantages` or :meth:`losses`.

Manual optimization: ``trainer.global_step`` counts optimizer steps (iterations x ppo_epochs x num_minibatches,
fewer when ``target_kl`` stops the epochs early). Metrics are logged against iterations (training batches);
bound a run with ``trainer.max_epochs`` over the prompt set or ``trainer.limit_train_batches``.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from torchmetrics import MeanMetric
from transformers import GenerationConfig, LogitsProcessorList

from rlhf_lightning.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    entropy_from_logits,
    explained_variance,
    gae,
    kl_penalty,
    logprobs_from_hidden,
    logprobs_from_logits,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)
from rlhf_lightning.data.collate import IGNORE_INDEX
from rlhf_lightning.metrics import reset_metrics
from rlhf_lightning.models.shared_base import REFERENCE, adapter_of
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.optim import Schedule
from rlhf_lightning.ppo.rewards import REWARD_ROLE, AdapterReward, RewardSource
from rlhf_lightning.ppo.rollout import (
    Draft,
    Rollout,
    Samples,
    close_with_eos,
    sequence_kl,
    stopped,
    token_rewards,
    truncate_after_stop,
)
from rlhf_lightning.ppo.sampling import sampling_processors
from rlhf_lightning.stage import StageModule

POLICY, CRITIC = "policy", "critic"


def derive_seed(*parts: object) -> int:
    """A seed that depends only on ``parts`` (Python's ``hash`` of strings changes between processes)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


class PPO(StageModule):
    """Proximal Policy Optimization of a causal LM against a reward model, with one frozen base.

    The policy and the critic are LoRA adapters on the base (the SFT model); the reference is the same base
    with adapters disabled; the reward model is by default the reward stage's adapter on it too.

    Args:
        base: the SFT model: frozen base of every role, and the reference policy.
        reward: how responses are scored: ``AdapterReward`` (the reward stage's adapter on this base),
            ``ModelReward`` (a separate model) or ``FunctionReward`` (a Python function).
        policy_lora: the policy adapter.
        critic_lora: the critic adapter (its value head is a plain linear layer).
        critic_from_reward: start the critic from the reward adapter and head (same LoRA shape needed).
        max_new_tokens: longest response, in tokens.
        temperature: sampling temperature; log-probs are computed from logits divided by it too.
        top_k: sample among the k most likely tokens; 0 = off (log-probs ignore this filter).
        top_p: nucleus-sampling threshold; 1.0 = off (log-probs ignore this filter).
        kv_cache: KV cache of generation: ``static`` allocates it once for prompt + ``max_new_tokens`` (no
            reallocation per token: faster, notably on CPU); ``dynamic`` grows it token by token (transformers'
            default, for models without static-cache support).
        stop_token: token that ends a response: ``eos`` (the tokenizer's), another token, or null (never stop).
        missing_eos_penalty: subtracted from the score of a response that never emits the stop token; null = off.
        kl_coef: coefficient of the per-token KL penalty (the initial one when ``kl_target`` is set).
        kl_estimator: per-token KL estimator in the reward: ``k1`` (log-ratio), ``k2`` or ``k3``.
        kl_target: target KL per sequence (nats) of the adaptive controller; null = fixed ``kl_coef``.
        kl_horizon: horizon of the adaptive controller, in samples.
        reward_normalize: standardise scores with the reward stage's validation mean and std.
        reward_clip: clip scores to [-reward_clip, reward_clip]; null = off.
        whiten_rewards: scale per-token rewards to unit variance (mean kept) before GAE.
        gamma: discount factor.
        lam: GAE lambda.
        whiten_advantages: standardise advantages over the valid tokens of the rollout batch.
        ppo_epochs: passes over each rollout batch.
        num_minibatches: minibatches, hence optimizer steps, per pass.
        gradient_accumulation: micro-batches per minibatch (less memory; same result).
        clip_range: epsilon of the clipped policy objective.
        clip_range_value: clipping of value predictions around the rollout's; null = unclipped.
        vf_coef: weight of the value loss.
        ent_coef: weight of the entropy bonus.
        ptx_coef: weight of the pretraining loss (PPO-ptx) on the data module's ``ptx`` batches; 0 = off.
        target_kl: stop an iteration's epochs once a minibatch's approximate KL exceeds this; null = never.
        max_grad_norm: clip the gradient norm to this; null = off.
        policy_lr: learning rate of the policy adapter.
        critic_lr: learning rate of the critic adapter and value head.
        weight_decay: AdamW weight decay.
        warmup_iterations: iterations of linear learning-rate warm-up.
        lr_schedule: decay after warm-up over the run's iterations: ``constant``, ``linear`` or ``cosine``.
        logprob_chunk: compute log-probs over this many response positions at a time, recomputing each chunk's
            logits in the backward pass instead of keeping them (less peak memory for large vocabularies, one more
            LM-head pass); null = all at once.
        backward: ``separate`` backpropagates the policy loss before the critic's forward pass, so the two graphs
            are never held together (less peak memory, same gradients); ``joint`` runs one backward for both, which
            DDP's reducer needs; ``auto`` = separate on one device, joint when distributed.
        reuse_first_pass: when the first update micro-batch is the whole rollout (one minibatch, no accumulation),
            take the old log-probs (and, with a joint backward, the values) from its forward pass instead of a
            separate scoring pass: the same numbers, one or two fewer forward passes per iteration.
        seed: rollout sampling seed; iteration i on rank r samples with a seed drawn from (seed, i, r), so a
            resumed run samples exactly what the uninterrupted one would have.
        gold_reward: ``fn(prompts, responses) -> scores`` of the true reward when known (the synthetic task's
            ``gold_rewards``), logged as ``ppo/objective/gold``; never used for training.
        export_dir: folder for the policy and critic adapters (peft format) at the end of ``fit``.
    """

    def __init__(
        self,
        base: BaseModelSpec,
        reward: RewardSource,
        policy_lora: LoraSpec = LoraSpec(),  # noqa: B008 (never mutated; the CLI shows it as the default)
        critic_lora: LoraSpec = LoraSpec(),  # noqa: B008
        critic_from_reward: bool = False,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        kv_cache: Literal["static", "dynamic"] = "static",
        stop_token: str | None = "eos",
        missing_eos_penalty: float | None = None,
        kl_coef: float = 0.05,
        kl_estimator: KLEstimator = "k1",
        kl_target: float | None = None,
        kl_horizon: int = 10_000,
        reward_normalize: bool = False,
        reward_clip: float | None = None,
        whiten_rewards: bool = False,
        gamma: float = 1.0,
        lam: float = 0.95,
        whiten_advantages: bool = True,
        ppo_epochs: int = 4,
        num_minibatches: int = 1,
        gradient_accumulation: int = 1,
        clip_range: float = 0.2,
        clip_range_value: float | None = 0.2,
        vf_coef: float = 0.1,
        ent_coef: float = 0.0,
        ptx_coef: float = 0.0,
        target_kl: float | None = None,
        max_grad_norm: float | None = 1.0,
        policy_lr: float = 1e-4,
        critic_lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_iterations: int = 0,
        lr_schedule: Schedule = "constant",
        logprob_chunk: int | None = None,
        backward: Literal["auto", "joint", "separate"] = "auto",
        reuse_first_pass: bool = True,
        seed: int = 0,
        gold_reward: Callable[[Sequence[str], Sequence[str]], Sequence[float]] | None = None,
        export_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["reward", "gold_reward"])
        self.automatic_optimization = False
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if kv_cache not in ("static", "dynamic"):
            raise ValueError(f"kv_cache must be static or dynamic, got {kv_cache!r}")
        if backward not in ("auto", "joint", "separate"):
            raise ValueError(f"backward must be auto, joint or separate, got {backward!r}")
        self.model = self.load_base(base)
        self.model.add_adapter(POLICY, policy_lora)
        self.model.add_adapter(CRITIC, critic_lora)
        self.model.add_head(CRITIC)
        self.reward = reward
        self.reward.setup(self.model, self.tokenizer)
        if critic_from_reward:
            if not isinstance(reward, AdapterReward):
                raise ValueError("critic_from_reward needs an AdapterReward: the critic copies its adapter and head")
            self.model.copy_adapter(REWARD_ROLE, CRITIC)
        if reward_normalize and reward.statistics is None:
            raise ValueError(f"reward_normalize needs the reward's mean/std (reward_stats.json), which {reward} lacks")
        self.gold_reward = gold_reward
        self.stop_token_id = self._stop_token_id(stop_token)
        self.last_samples: Samples | None = None  # the latest rollout as text (see callbacks.CompletionsTable)
        self.kl_controller = (
            FixedKLController(kl_coef) if kl_target is None
            else AdaptiveKLController(kl_coef, kl_target, kl_horizon)
        )
        self.model.train()  # peft loads adapters in eval mode; with dropout off both modes compute the same
        self.val_metrics = torch.nn.ModuleDict(
            {name: MeanMetric() for name in ("score", "kl", "length", "eos_frac", "gold")}
        )

    def _stop_token_id(self, stop_token: str | None) -> int | None:
        if stop_token is None:
            return None
        if stop_token == "eos":
            return self.tokenizer.eos_token_id
        token_id = self.tokenizer.convert_tokens_to_ids(stop_token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"stop_token {stop_token!r} is not a single token of the tokenizer")
        return token_id

    @property
    def generation_config(self) -> GenerationConfig:
        """How :meth:`sample_sequences` calls ``generate``; the sampling itself is :meth:`sampling_processors`."""
        # Every logits processor is set explicitly: a model's own generation_config.json must not change the
        # sampling distribution behind the log-probs' back. Greedy over the sampler's one-hot output = sampling.
        # disable_compile: with a static cache on a GPU, transformers would otherwise torch.compile the forward
        # pass on its own (and recompile for every new prompt length).
        return GenerationConfig(
            do_sample=False, max_new_tokens=self.hparams.max_new_tokens, min_new_tokens=0, repetition_penalty=1.0,
            no_repeat_ngram_size=0, eos_token_id=[] if self.stop_token_id is None else self.stop_token_id,
            pad_token_id=self.tokenizer.pad_token_id, use_cache=True, cache_implementation=self.hparams.kv_cache,
            disable_compile=True,
        )

    def sampling_processors(self) -> LogitsProcessorList:
        """Temperature, top-k and top-p (transformers' warpers), then our inverse-CDF sampler."""
        hp = self.hparams
        return sampling_processors(hp.temperature, hp.top_k, hp.top_p)

    # ---- 1. rollout ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def sample_sequences(self, role: str | None, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Prompts followed by up to ``max_new_tokens`` sampled from ``role`` (eval mode, KV cache; fewer once every
        row has stopped): ``[B, P + N]``."""
        was_training = self.model.training
        self.model.eval()
        try:
            with self.model.role(role):
                return self.model.hf_model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                                    generation_config=self.generation_config,
                                                    logits_processor=self.sampling_processors())
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Sample responses from the policy: ``(prompt+response ids, attention mask, response mask [B, R])``."""
        sequences = self.sample_sequences(POLICY, input_ids, attention_mask)
        responses, response_mask = truncate_after_stop(
            sequences[:, input_ids.shape[1]:], self.stop_token_id, self.tokenizer.pad_token_id
        )
        return (torch.cat([input_ids, responses], 1), torch.cat([attention_mask, response_mask.long()], 1),
                response_mask)

    def response_hidden_states(self, role: str | None, input_ids: Tensor, attention_mask: Tensor,
                               response_length: int) -> Tensor:
        """Hidden states of ``role`` at the positions that predict the response tokens: ``[B, R, H]``."""
        with self.model.role(role):
            hidden = self.model.hidden_states(input_ids, attention_mask)
        return hidden[:, -response_length - 1 : -1]

    def response_logprobs(self, role: str | None, input_ids: Tensor, attention_mask: Tensor, responses: Tensor,
                          with_entropy: bool = False, entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
        """``(log-probs [B, R], entropy [B, R] or None)`` of ``responses`` under ``role`` at the sampling
        temperature.

        The LM head runs only on response positions, optionally ``logprob_chunk`` positions at a time, so the
        full ``[B, T, V]`` logits never exist at once; with a chunk size, each chunk's logits are recomputed in
        the backward pass rather than kept for it. ``entropy_grad=False`` computes the entropy as a detached
        statistic, so its ``[B, R, V]`` softmax is not kept for a backward.
        """
        hidden = self.response_hidden_states(role, input_ids, attention_mask, responses.shape[1])
        chunk = self.hparams.logprob_chunk or responses.shape[1]
        recompute = self.hparams.logprob_chunk is not None and torch.is_grad_enabled() and hidden.requires_grad
        # The fused head keeps one [B, R, V] tensor for the backward; an entropy bonus needs the plain path.
        fused = self._fused_head() and not (with_entropy and entropy_grad and torch.is_grad_enabled())
        compute = self._fused_chunk if fused else self._chunk_logprobs
        logprobs, entropies = [], []
        for start in range(0, responses.shape[1], chunk):
            piece, labels = hidden[:, start : start + chunk], responses[:, start : start + chunk]
            if recompute:
                logprob, entropy = checkpoint(compute, piece, labels, with_entropy, entropy_grad, use_reentrant=False)
            else:
                logprob, entropy = compute(piece, labels, with_entropy, entropy_grad)
            logprobs.append(logprob)
            entropies.append(entropy)
        return torch.cat(logprobs, 1), torch.cat(entropies, 1) if with_entropy else None

    def _fused_head(self) -> bool:
        head = self.model.lm_head
        return isinstance(head, torch.nn.Linear) and head.bias is None

    def _fused_chunk(self, hidden: Tensor, labels: Tensor, with_entropy: bool,
                     entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
        return logprobs_from_hidden(hidden, self.model.lm_head.weight, labels, self.hparams.temperature,
                                    with_entropy)

    def _chunk_logprobs(self, hidden: Tensor, labels: Tensor, with_entropy: bool,
                        entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
        logits = self._chunk_logits(hidden)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
                entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
        return logprobs_from_logits(logits, labels), entropy

    def _chunk_logits(self, hidden: Tensor) -> Tensor:
        # Contiguous first: matmul does not fold a strided slice that requires grad into one 2-D product and
        # takes a slower batched path instead.
        return self.model.lm_head(hidden.contiguous()).float() / self.hparams.temperature

    def response_values(self, input_ids: Tensor, attention_mask: Tensor, response_length: int) -> Tensor:
        """Critic values ``[B, R]`` of the states before each response token."""
        hidden = self.response_hidden_states(CRITIC, input_ids, attention_mask, response_length)
        return self.model.heads[CRITIC](hidden)

    def decode(self, ids: Tensor, mask: Tensor) -> list[str]:
        return [self.tokenizer.decode(row[keep], skip_special_tokens=True) for row, keep in zip(ids, mask.bool(),
                                                                                                  strict=True)]

    @torch.no_grad()
    def rollout(self, prompts: dict[str, Any]) -> tuple[Rollout, dict[str, Tensor]]:
        """Sample and score a batch of responses; return the rollout (advantages included) and its statistics."""
        return self.complete_rollout(self.sample_and_score(prompts))

    @torch.no_grad()
    def sample_and_score(self, prompts: dict[str, Any], policy: bool = True, critic: bool = True) -> Draft:
        """Sample responses and run the scoring passes: reference log-probs and reward always, the policy's
        log-probs and the critic's values unless left to the first update pass (``policy``/``critic`` False)."""
        input_ids, attention_mask, response_mask = self.generate(prompts["input_ids"], prompts["attention_mask"])
        responses = input_ids[:, prompts["input_ids"].shape[1]:]
        logprobs = entropy = values = None
        if policy:
            logprobs, entropy = self.response_logprobs(POLICY, input_ids, attention_mask, responses,
                                                       with_entropy=True)
        ref_logprobs, _ = self.response_logprobs(REFERENCE, input_ids, attention_mask, responses)
        if critic:
            values = self.masked_values(input_ids, attention_mask, response_mask)
        response_texts = self.decode(responses, response_mask)
        raw_scores = self.score(input_ids, attention_mask, prompts["prompt"], response_texts)
        is_stopped = stopped(responses, response_mask, self.stop_token_id)
        rollout = Rollout(input_ids, attention_mask, response_mask, logprobs, ref_logprobs, values,
                          self.process_scores(raw_scores, is_stopped))
        return Draft(rollout, entropy, raw_scores, is_stopped, list(prompts["prompt"]), response_texts)

    def masked_values(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
        """Critic values ``[B, R]``, 0 after each response's end (what the rollout stores)."""
        return torch.where(response_mask, self.response_values(input_ids, attention_mask, response_mask.shape[1]),
                           0.0)

    @torch.no_grad()
    def complete_rollout(self, draft: Draft) -> tuple[Rollout, dict[str, Tensor]]:
        """Rewards, advantages and statistics of a scored draft (its log-probs and values filled in)."""
        rollout, response_mask = draft.rollout, draft.rollout.response_mask
        logprobs, ref_logprobs, raw_scores = rollout.logprobs, rollout.ref_logprobs, draft.raw_scores
        rewards, kl = self.shape_rewards(rollout)
        rollout.advantages, rollout.returns = self.estimate_advantages(rollout, rewards)

        kl_per_sequence = sequence_kl(logprobs, ref_logprobs, response_mask)
        stats = {
            "objective/score": raw_scores.mean(),
            "objective/score_std": raw_scores.std() if raw_scores.numel() > 1 else torch.zeros(()),
            "objective/kl": kl_per_sequence.mean(),
            "objective/kl_penalty": (torch.where(response_mask, kl, 0.0)).sum(-1).mean(),
            "objective/kl_coef": torch.tensor(self.kl_controller.value),
            "objective/rlhf_reward": (torch.where(response_mask, rewards, 0.0)).sum(-1).mean(),
            "policy/entropy": masked_mean(draft.entropy, response_mask),
            "response/length": response_mask.sum(-1).float().mean(),
            "response/eos_frac": draft.is_stopped.float().mean(),
            "value/explained_variance": explained_variance(rollout.values, rollout.returns, response_mask),
            "value/mean": masked_mean(rollout.values, response_mask),
        }
        gold = None
        if self.gold_reward is not None:
            gold = [float(g) for g in self.gold_reward(draft.prompts, draft.responses)]
            stats["objective/gold"] = torch.tensor(gold).mean()
        self.last_samples = Samples(self.iteration, draft.prompts, draft.responses, raw_scores.tolist(),
                                    kl_per_sequence.tolist(), gold)
        return rollout, stats

    def score(self, input_ids: Tensor, attention_mask: Tensor, prompts: Sequence[str],
              responses: Sequence[str]) -> Tensor:
        """Reward-model scores ``[B]``, each read at an EOS (appended to responses that never emitted one)."""
        ids, mask, last = close_with_eos(input_ids, attention_mask, self.tokenizer.eos_token_id)
        return self.reward.score(ids, mask, last, prompts, responses).float()

    def process_scores(self, scores: Tensor, is_stopped: Tensor) -> Tensor:
        """Normalise with the reward stage's statistics, penalise responses that never stop, clip."""
        hp = self.hparams
        if hp.reward_normalize:
            mean, std = self.reward.statistics
            scores = (scores - mean) / max(std, 1e-8)
        if hp.missing_eos_penalty is not None:
            scores = scores - hp.missing_eos_penalty * (~is_stopped).float()
        if hp.reward_clip is not None:
            scores = scores.clamp(-hp.reward_clip, hp.reward_clip)
        return scores

    # ---- 2. rewards and advantages ------------------------------------------------------------------------

    def shape_rewards(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """Per-token rewards ``[B, R]`` (KL penalty on every token, score on the last) and the per-token KL."""
        kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, self.hparams.kl_estimator)
        rewards = token_rewards(rollout.scores, kl, rollout.response_mask, self.kl_controller.value)
        if self.hparams.whiten_rewards:
            rewards = masked_whiten(rewards, rollout.response_mask, shift_mean=False)
        return rewards, kl

    def estimate_advantages(self, rollout: Rollout, rewards: Tensor) -> tuple[Tensor, Tensor]:
        """GAE advantages and returns ``[B, R]``; advantages whitened over the batch's valid tokens."""
        hp = self.hparams
        advantages, returns = gae(rewards, rollout.values, rollout.response_mask, hp.gamma, hp.lam)
        if hp.whiten_advantages:
            advantages = masked_whiten(advantages, rollout.response_mask)
        return advantages, returns

    # ---- 3. PPO epochs ------------------------------------------------------------------------------------

    def losses(self, minibatch: Rollout, ptx: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """All loss terms of one micro-batch; ``total`` is what is backpropagated.

        With a joint backward the policy and critic passes both feed one backward, so every trainable parameter
        gets its gradient in the same pass (which DDP's gradient reducer needs). A subclass that overrides this
        method always gets the joint backward.
        """
        policy_total, terms = self.policy_losses(minibatch, ptx)
        critic_total, critic_terms = self.critic_losses(minibatch)
        return {**terms, **critic_terms, "loss/total": policy_total + critic_total}

    def policy_losses(self, minibatch: Rollout, ptx: dict[str, Tensor] | None, logprobs: Tensor | None = None,
                      entropy: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """``(policy part of the total loss, its terms)``: clipped policy loss, - entropy bonus, + PPO-ptx.

        ``logprobs``/``entropy`` are the policy pass's outputs when already computed on ``minibatch``.
        """
        hp = self.hparams
        mask = minibatch.response_mask
        if logprobs is None:
            logprobs, entropy = self.response_logprobs(POLICY, minibatch.input_ids, minibatch.attention_mask,
                                                       minibatch.responses, with_entropy=bool(hp.ent_coef))
        policy = policy_loss(logprobs, minibatch.logprobs, minibatch.advantages, mask, hp.clip_range)
        terms = {
            "loss/policy": policy.loss,
            "policy/approx_kl": policy.approx_kl,
            "policy/clipfrac": policy.clipfrac,
            "policy/ratio": policy.ratio_mean,
        }
        total = policy.loss
        if hp.ent_coef:
            mean_entropy = masked_mean(entropy, mask)
            total = total - hp.ent_coef * mean_entropy
            terms["loss/entropy"] = mean_entropy
        if hp.ptx_coef and ptx is not None:
            terms["loss/ptx"] = self.ptx_loss(ptx)
            total = total + hp.ptx_coef * terms["loss/ptx"]
        return total, terms

    def critic_losses(self, minibatch: Rollout, values: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """``(critic part of the total loss, its terms)``: ``vf_coef`` x clipped value loss."""
        hp = self.hparams
        mask = minibatch.response_mask
        if values is None:
            values = self.response_values(minibatch.input_ids, minibatch.attention_mask, mask.shape[1])
        value = value_loss(values, minibatch.values, minibatch.returns, mask, hp.clip_range_value)
        return hp.vf_coef * value.loss, {"loss/value": value.loss, "value/clipfrac": value.clipfrac}

    def ptx_loss(self, batch: dict[str, Tensor]) -> Tensor:
        """Next-token loss of the policy on pretraining/SFT text (the PPO-ptx term of InstructGPT)."""
        with self.model.role(POLICY):
            hidden = self.model.hidden_states(batch["input_ids"], batch["attention_mask"])
        logits = self.model.lm_head(hidden[:, :-1].contiguous()).float()  # contiguous: see _chunk_logits
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX)

    def update(self, rollout: Rollout, ptx: dict[str, Tensor] | None,
               draft: Draft | None = None) -> dict[str, Tensor]:
        """``ppo_epochs`` passes of minibatch updates; returns the mean of every term over the micro-batches.

        With ``draft`` (a rollout whose policy log-probs, and maybe values, are still missing), the first
        micro-batch's forward pass provides them; the completed rollout's statistics join the returned ones.
        """
        hp = self.hparams
        optimizer = self.optimizers()
        batch_size = rollout.response_mask.shape[0]
        minibatch_size, micro_size = self._minibatch_sizes(batch_size)
        sums: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        rollout_stats: dict[str, Tensor] = {}
        micro_count, epochs_run, early_stopped = 0, 0, False
        for _ in range(hp.ppo_epochs):
            epochs_run += 1
            order = torch.randperm(batch_size, device=self.device)
            for minibatch in order.split(minibatch_size):
                minibatch_kl = torch.zeros((), device=self.device)
                for index, micro in enumerate(minibatch.split(micro_size)):
                    if draft is not None:
                        terms, rollout, rollout_stats = self._first_pass_step(draft, micro, ptx)
                        draft = None
                    else:
                        terms = self._micro_step(rollout.select(micro), ptx if index == 0 else None)
                    for name, value in terms.items():
                        sums[name] += value.detach()
                    minibatch_kl += terms["policy/approx_kl"].detach() / hp.gradient_accumulation
                    micro_count += 1
                sums["grad_norm"] += self._gradient_norm() * hp.gradient_accumulation
                if hp.max_grad_norm is not None:
                    self.clip_gradients(optimizer, gradient_clip_val=hp.max_grad_norm,
                                        gradient_clip_algorithm="norm")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                # Every rank must take the same decision, or DDP would wait for a backward that never comes.
                if hp.target_kl is not None and self._all_mean(minibatch_kl) > hp.target_kl:
                    early_stopped = True
                    break
            if early_stopped:
                break
        stats = {name: total / micro_count for name, total in sums.items()}
        stats["policy/epochs"] = torch.tensor(float(epochs_run))
        stats["policy/early_stopped"] = torch.tensor(float(early_stopped))
        return {**rollout_stats, **stats}

    @property
    def joint_backward(self) -> bool:
        """One backward for the policy and critic losses (see the ``backward`` argument)."""
        if self.hparams.backward == "auto":
            distributed = self._trainer is not None and self.trainer.world_size > 1
            return distributed or type(self).losses is not PPO.losses
        return self.hparams.backward == "joint" or type(self).losses is not PPO.losses

    def _micro_step(self, micro: Rollout, ptx: dict[str, Tensor] | None, logprobs: Tensor | None = None,
                    entropy: Tensor | None = None, values: Tensor | None = None) -> dict[str, Tensor]:
        """Losses and backward of one micro-batch (the policy's and critic's passes given, when already run)."""
        scale = 1.0 / self.hparams.gradient_accumulation
        if self.joint_backward:
            if logprobs is None and values is None:
                terms = self.losses(micro, ptx)
            else:
                policy_total, terms = self.policy_losses(micro, ptx, logprobs, entropy)
                critic_total, critic_terms = self.critic_losses(micro, values)
                terms = {**terms, **critic_terms, "loss/total": policy_total + critic_total}
            self.manual_backward(terms["loss/total"] * scale)
            return terms
        # The policy graph is freed by its backward before the critic's forward pass builds the next one.
        policy_total, terms = self.policy_losses(micro, ptx, logprobs, entropy)
        self.manual_backward(policy_total * scale)
        critic_total, critic_terms = self.critic_losses(micro, values)
        self.manual_backward(critic_total * scale)
        return {**terms, **critic_terms, "loss/total": policy_total.detach() + critic_total.detach()}

    def _first_pass_step(self, draft: Draft, rows: Tensor,
                         ptx: dict[str, Tensor] | None) -> tuple[dict[str, Tensor], Rollout, dict[str, Tensor]]:
        """The first micro-batch (the whole rollout, in the order ``rows``) when its forward passes also score it.

        Before any optimizer step the policy (and critic) are those of sampling time, so the pass's outputs,
        detached, are exactly the rollout's old log-probs (and values); the rollout is completed with them
        (rewards, advantages) and the same outputs then feed the losses.
        """
        hp = self.hparams
        rollout = draft.rollout
        micro = rollout.select(rows)
        mask = micro.response_mask
        logprobs, entropy = self.response_logprobs(POLICY, micro.input_ids, micro.attention_mask, micro.responses,
                                                   with_entropy=True, entropy_grad=bool(hp.ent_coef))
        values = None
        if rollout.values is None:
            values = self.response_values(micro.input_ids, micro.attention_mask, mask.shape[1])
        with torch.no_grad():
            inverse = torch.empty_like(rows)
            inverse[rows] = torch.arange(rows.numel(), device=rows.device)
            rollout.logprobs = logprobs.detach()[inverse]
            draft.entropy = entropy.detach()[inverse]
            if values is not None:
                rollout.values = torch.where(mask, values.detach(), 0.0)[inverse]
        rollout, rollout_stats = self.complete_rollout(draft)
        micro = rollout.select(rows)
        return self._micro_step(micro, ptx, logprobs, entropy, values), rollout, rollout_stats

    def _reuses_first_pass(self, batch_size: int) -> bool:
        """Whether the first update micro-batch is the whole rollout, so its passes can score it."""
        hp = self.hparams
        return (hp.reuse_first_pass and hp.num_minibatches == 1 and hp.gradient_accumulation == 1
                and type(self).losses is PPO.losses and self._minibatch_sizes(batch_size)[1] == batch_size)

    def _minibatch_sizes(self, batch_size: int) -> tuple[int, int]:
        hp = self.hparams
        if batch_size % hp.num_minibatches or (batch_size // hp.num_minibatches) % hp.gradient_accumulation:
            raise ValueError(
                f"the rollout batch of {batch_size} prompts must split into num_minibatches={hp.num_minibatches} "
                f"minibatches of gradient_accumulation={hp.gradient_accumulation} equal micro-batches; "
                "change data.init_args.batch_size or these two"
            )
        minibatch_size = batch_size // hp.num_minibatches
        return minibatch_size, minibatch_size // hp.gradient_accumulation

    def _gradient_norm(self) -> Tensor:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads \
            else torch.zeros((), device=self.device)

    def _all_mean(self, value: Tensor) -> float:
        return float(self.trainer.strategy.reduce(value, reduce_op="mean"))

    # ---- the iteration ------------------------------------------------------------------------------------

    @property
    def iteration(self) -> int:
        """PPO iterations completed before the current one (training batches, across epochs); 0 outside a fit."""
        return 0 if self._trainer is None else self.trainer.fit_loop.epoch_loop.total_batch_idx

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        start = time.perf_counter()
        torch.manual_seed(derive_seed(self.hparams.seed, "train", self.iteration, self.global_rank))
        if self._reuses_first_pass(batch["prompts"]["input_ids"].shape[0]):
            # The first update pass scores the policy (and with a joint backward the critic) for the rollout.
            draft = self.sample_and_score(batch["prompts"], policy=False, critic=not self.joint_backward)
            rollout_seconds = time.perf_counter() - start
            stats = self.update(draft.rollout, batch.get("ptx"), draft=draft)
            rollout = draft.rollout
        else:
            rollout, stats = self.rollout(batch["prompts"])
            rollout_seconds = time.perf_counter() - start
            stats.update(self.update(rollout, batch.get("ptx")))
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        world_samples = rollout.response_mask.shape[0] * self.trainer.world_size
        self.kl_controller.update(self._all_mean(stats["objective/kl"]), world_samples)

        seconds = time.perf_counter() - start
        generated = rollout.response_mask.sum().float()
        optimizer = self.optimizers()
        stats.update({
            "time/rollout": torch.tensor(rollout_seconds),
            "time/update": torch.tensor(seconds - rollout_seconds),
            "time/iteration": torch.tensor(seconds),
            "throughput/tokens_per_second": generated / seconds,
            "lr/policy": torch.tensor(optimizer.param_groups[0]["lr"]),
            "lr/critic": torch.tensor(optimizer.param_groups[-1]["lr"]),
            "iteration": torch.tensor(float(self.iteration + 1)),
        })
        self.log_dict({f"ppo/{name}": value.float() for name, value in stats.items()}, sync_dist=True,
                      batch_size=rollout.response_mask.shape[0])
        self.log_dict({"iteration": stats["iteration"], "reward": stats["objective/score"],
                       "kl": stats["objective/kl"],
                       **({"gold": stats["objective/gold"]} if "objective/gold" in stats else {})},
                      prog_bar=True, logger=False)

    def configure_optimizers(self):
        hp = self.hparams
        adapters = {POLICY: [], CRITIC: []}
        for name, parameter in self.model.model.named_parameters():
            if adapter_of(name) in adapters:
                adapters[adapter_of(name)].append(parameter)
        groups = [
            {"params": adapters[POLICY], "lr": hp.policy_lr},
            {"params": adapters[CRITIC] + list(self.model.heads[CRITIC].parameters()), "lr": hp.critic_lr},
        ]
        # The schedule's total is the Trainer's estimate: training batches = iterations when max_steps is unset.
        return self.configure_adamw(groups, hp.weight_decay, hp.warmup_iterations, hp.lr_schedule)

    # ---- evaluation on held-out prompts -------------------------------------------------------------------

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # Same sampling noise at every evaluation, and training's random stream left untouched.
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed(self.hparams.seed, "validation", batch_idx, self.global_rank))
            input_ids, attention_mask, response_mask = self.generate(batch["input_ids"], batch["attention_mask"])
        responses = input_ids[:, batch["input_ids"].shape[1]:]
        logprobs, _ = self.response_logprobs(POLICY, input_ids, attention_mask, responses)
        ref_logprobs, _ = self.response_logprobs(REFERENCE, input_ids, attention_mask, responses)
        texts = self.decode(responses, response_mask)
        scores = self.score(input_ids, attention_mask, batch["prompt"], texts)
        metrics = self.val_metrics
        metrics["score"].update(scores)
        metrics["kl"].update(sequence_kl(logprobs, ref_logprobs, response_mask))
        metrics["length"].update(response_mask.sum(-1).float())
        metrics["eos_frac"].update(stopped(responses, response_mask, self.stop_token_id).float())
        if self.gold_reward is not None:
            metrics["gold"].update(torch.tensor(list(self.gold_reward(list(batch["prompt"]), texts))))

    def on_validation_epoch_end(self) -> None:
        for name, metric in self.val_metrics.items():
            if metric.update_count:
                self.log(f"ppo/val/{name}", metric.compute())
        reset_metrics(*self.val_metrics.values())

    # ---- checkpoints and export ---------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["kl_controller"] = self.kl_controller.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.kl_controller.load_state_dict(checkpoint["kl_controller"])

    def on_fit_end(self) -> None:
        if self.hparams.export_dir and self.trainer.is_global_zero:
            self.export(self.hparams.export_dir)

    def export(self, directory: str | Path) -> dict[str, Path]:
        """Write the policy and the critic (adapter + value head) in peft format under ``directory``.

        ``python -m rlhf_lightning merge --adapter DIR/policy --out MERGED`` makes a standalone model of the
        policy.
        """
        return {role: self.model.save_adapter(role, directory) for role in (POLICY, CRITIC)}
