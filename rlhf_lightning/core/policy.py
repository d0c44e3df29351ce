"""A policy adapter on one frozen base whose adapters-disabled view is the reference model.

What every policy-optimising stage shares (the online RL family and DPO): the base and the ``policy`` adapter,
log-probabilities of any role from a response mask (left-padded rollouts and right-padded preference pairs
alike), its sampler (:mod:`rlhf_lightning.rollout`), and the evaluation of sampled responses on held-out prompts
(KL to the reference, length, stop rate, and the task's gold reward when it has one).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.parsing import collect_init_args
from torch import Tensor

from rlhf_lightning.core.distributed import sharding_mesh
from rlhf_lightning.core.held_out import POLICY, HeldOutSamples
from rlhf_lightning.core.held_out_pass_at_k import PassAtK, answer_reader
from rlhf_lightning.core.stage import StageModule
from rlhf_lightning.models.logprobs import predicting_hidden_states, token_logprobs
from rlhf_lightning.models.shared_base import SharedBase, adapter_of
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.rollout.engines import Auto, Engine, EngineSetup
from rlhf_lightning.rollout.rollouts import Rollout, Rollouts
from rlhf_lightning.rollout.sampler import Sampler
from rlhf_lightning.rollout.seeds import Seeds
from rlhf_lightning.rollout.settings import Sampling
from rlhf_lightning.utils import checks

log = logging.getLogger(__name__)

GoldReward = Callable[[Sequence[str], Sequence[str]], Sequence[float]]


def without_dropout(lora: LoraSpec, role: str) -> LoraSpec:
    """``lora`` with dropout 0: a policy whose log-probs change from pass to pass has a ratio != 1 before any
    step and a KL to itself."""
    if lora.dropout:
        log.warning("LoRA dropout %s of the %s adapter set to 0: rollout and update passes must agree",
                    lora.dropout, role)
        lora = dataclasses.replace(lora, dropout=0.0)
    return lora


def pad_to_sequence(response_mask: Tensor, length: int) -> Tensor:
    """A rollout's response mask ``[B, R]`` in the coordinates of its ``[B, length]`` sequences (responses last)."""
    prompt = response_mask.new_zeros((response_mask.shape[0], length - response_mask.shape[1]))
    return torch.cat([prompt, response_mask], 1)


class PolicyModule(StageModule):
    """The base model with a trainable ``policy`` LoRA adapter; the reference is the base, adapters disabled.

    Args:
        base: the SFT model: frozen base of every role, and the reference policy.
        policy_lora: the policy adapter (its dropout is forced to 0).
        sampling: how responses are drawn (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``kv_cache``,
            ``stop_token``; see :class:`~rlhf_lightning.rollout.settings.Sampling`).
        engine: what draws the responses (``rlhf_lightning.rollout.engines``; its options are its own init args):
            ``Auto`` = ``CompiledDecoder`` on CUDA, ``EagerDecoder`` elsewhere and under FSDP2, ``Generate`` with a
            dynamic cache. ``EagerDecoder`` = our loop over a static KV cache, each prompt encoded once for its
            ``samples_per_prompt`` responses; ``CompiledDecoder`` = the same loop with its decode step
            ``torch.compile``-d (CUDA graphs on a GPU: about one launch per token; compiled once per batch size and
            64-token prompt bucket); ``Generate`` = transformers' ``generate`` (every row encodes its prompt). All
            draw the same tokens (compiled: up to kernel rounding). ``rlhf_lightning.rollout.vllm_engine.VLLMEngine``
            = vLLM in this process (one per DDP rank; Llama-, Qwen2-shaped models...), with its own copy of the base
            and the sampled adapter pushed after every update: other tokens than ours, its log-probs logged against
            the trainer's. Or an engine of your own (a subclass of ``Engine``).
        logprob_chunk: compute log-probs over this many positions at a time, recomputing each chunk's logits in
            the backward pass instead of keeping them (less peak memory for large vocabularies, one more LM-head
            pass); null = all at once.
        seed: sampling seed; a resumed run samples exactly what the uninterrupted one would have; evaluations use
            fixed seeds.
        seed_scope: ``rank``: iteration i on rank r samples from one random stream seeded by (seed, i, r);
            ``prompt``: each response is drawn from a stream of its own, seeded by (seed, i, the prompt's row in
            its dataset, the sample's number), so the responses do not depend on how prompts are split over ranks
            and batches: one process and N ranks sample the same ones (the distributed equivalence tests use it).
        sharded_rollout: under FSDP2 (``ModelParallelStrategy``), ``gathered`` all-gathers each decoder layer once
            per rollout and keeps the whole base on every rank while it samples and scores (fast: one all-gather
            per layer per rollout); ``per_layer`` gathers a layer for each forward pass and frees it after (the
            memory of one layer, but one all-gather per layer per decoded token). Ignored without sharding.
        gold_reward: ``fn(prompts, responses) -> scores`` of the true reward when known (the synthetic task's
            ``gold_rewards``), measured on samples and logged; never used for training. One with ``**kwargs`` also
            gets the prompt data's other columns (a checker that reads each row's reference); with a ``task`` column
            the held-out gold is also logged per task (``val/gold/<task>``).
        pass_at_k: pass@k and maj@k of several responses per held-out prompt, judged by ``gold_reward`` (a verifier,
            e.g. ``rlhf_lightning.tasks.arithmetic.exact_match``), logged as ``val/pass@k`` and ``val/maj@k``;
            ``samples: 1`` = off.
        export_dir: folder for the trained adapters (peft format) at the end of ``fit``, under the run folder
            (``trainer.default_root_dir``) unless absolute; null = do not export.
    """

    metric_prefix = "policy"  # namespace of the logged metrics (``ppo``, ``grpo``, ``dpo``...)
    default_sampling = Sampling()  # the ``sampling`` a dict of some of its fields is taken over
    exported_roles: tuple[str, ...] = (POLICY,)  # adapters written by :meth:`export`
    sampled_roles: tuple[str, ...] = (POLICY,)  # adapters the engine samples from: synced after each optimizer step
    validation_metrics: tuple[str, ...] = ("kl", "length", "eos_frac", "gold")  # per-sample, averaged

    def __init__(
        self,
        base: BaseModelSpec,
        policy_lora: LoraSpec = LoraSpec(),  # noqa: B008 (never mutated; the CLI shows it as the default)
        sampling: Sampling = default_sampling,
        engine: Engine = Auto(),  # noqa: B008 (stateless until its first draw; the CLI shows it as the default)
        logprob_chunk: int | None = None,
        seed: int = 0,
        seed_scope: Literal["rank", "prompt"] = "rank",
        sharded_rollout: Literal["gathered", "per_layer"] = "gathered",
        gold_reward: GoldReward | None = None,
        pass_at_k: PassAtK = PassAtK(),  # noqa: B008 (never mutated; the CLI shows it as the default)
        export_dir: str | None = None,
    ) -> None:
        checks.at_least("logprob_chunk", logprob_chunk, optional=True)
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an Engine (rlhf_lightning.rollout.engines: Auto, EagerDecoder, "
                            f"CompiledDecoder, Generate; rlhf_lightning.rollout.vllm_engine.VLLMEngine; or a "
                            f"subclass of your own), got {engine!r}")
        checks.one_of("seed_scope", seed_scope, ("rank", "prompt"))
        checks.one_of("sharded_rollout", sharded_rollout, ("gathered", "per_layer"))
        super().__init__(base)
        self.save_hyperparameters(ignore=["reward", "gold_reward", "episodes", "engine"])
        # Under LightningCLI the saved hyper-parameters are the config's, which lack what a subclass passes to its
        # parent itself (e.g. PPO(gamma=0.99) fixed in a subclass): add every __init__ level's own arguments.
        for level in collect_init_args(inspect.currentframe(), []):
            self.hparams.update({name: value for name, value in level.items()
                                 if name not in self.hparams
                                 and name not in ("reward", "gold_reward", "episodes", "engine")})
        self.sampling = self.keep_group("sampling", sampling, self.default_sampling)
        self.policy_lora = without_dropout(policy_lora.check("policy_lora"), POLICY)
        self.gold_reward = gold_reward
        self.engine = engine
        self.pass_at_k = pass_at_k.check()
        if pass_at_k.enabled and gold_reward is None:
            raise ValueError(f"pass_at_k.samples={pass_at_k.samples} needs gold_reward: pass@k and maj@k count the "
                             "responses a verifier judges correct (e.g. rlhf_lightning.tasks.arithmetic.exact_match)")
        names = [*self.validation_metrics]
        if pass_at_k.enabled:
            names += pass_at_k.metric_names(with_majority=answer_reader(gold_reward) is not None)
        self.held_out = HeldOutSamples(self, names, gold=gold_reward is not None)
        # Registered here so that the evaluation's metrics move to the module's device with it.
        self.val_metrics, self.val_gold_spread = self.held_out.metrics, self.held_out.gold_spread
        self._sampler: Sampler | None = None
        self._rollouts: Rollouts | None = None

    def build_model(self, empty: bool) -> SharedBase:
        model = self.load_base(empty=empty)
        model.add_adapter(POLICY, self.policy_lora)
        return model

    @property
    def sampler(self) -> Sampler:
        """What draws the policy's responses: the sampling settings (stop tokens from the tokenizer), the seeds, the
        engine and the sharded base's gathering."""
        if self._sampler is None:
            hp = self.hparams
            self._sampler = Sampler(self.sampling.settings(self.tokenizer), Seeds(hp.seed, hp.seed_scope),
                                    self.tokenizer.pad_token_id, hp.sharded_rollout, self.engine)
        return self._sampler

    @property
    def rollouts(self) -> Rollouts:
        """The turn loop of this module's rollouts (single-turn here; episodes with an online algorithm's
        ``environment``)."""
        if self._rollouts is None:
            self._rollouts = self.make_rollouts()
        return self._rollouts

    def make_rollouts(self) -> Rollouts:
        """The :class:`~rlhf_lightning.rollout.rollouts.Rollouts` of :attr:`rollouts`."""
        return Rollouts(self.sampler, self.tokenizer)

    def setup(self, stage: str) -> None:
        self.sampler  # noqa: B018 (a stop_token the tokenizer lacks fails here, before the model is built)
        if self.samples_responses:
            self.refuse_engine()
        super().setup(stage)

    def refuse_engine(self) -> None:
        """Before the model is built: what the engine cannot serve (:meth:`Engine.refusal`), in one line; then the
        engine keeps what it needs of the setup (:meth:`Engine.prepare`)."""
        trainer = self._trainer
        setup = EngineSetup(device_type=trainer.strategy.root_device.type if trainer is not None else "cpu",
                            sharded=sharding_mesh(trainer) is not None, kv_cache=self.sampling.kv_cache,
                            name_or_path=self.base_spec.name_or_path, adapters={POLICY: self.policy_lora},
                            run_folder=None if trainer is None else str(trainer.default_root_dir))
        refusal = self.engine.refusal(setup)
        if refusal is not None:
            raise ValueError(refusal)
        self.engine.prepare(setup)

    def check_lengths(self, datamodule: Any) -> None:
        """Prompts and the responses sampled after them must fit the model's positions (pairs too, for DPO); with an
        environment, every position a turn can reach: the longest prompt's opening (the chat template's markers and
        the tools' schemas included) and the episode, whose last turn can start one token before the budget and
        decode ``sampling.max_new_tokens``."""
        if hasattr(datamodule, "longest_prompt"):  # preference pairs: the pairs themselves, then their prompts
            super().check_lengths(datamodule)
        if not self.samples_responses:
            return
        if self.rollouts.environment is not None:
            examples = [*(datamodule.train_set or []), *datamodule.val_set]
            longest = max(examples, key=datamodule.length)
            reach = self.rollouts.reach(longest.raw if longest.raw is not None else longest.text)
            return self.check_positions(*reach, "lower episodes.max_tokens (null = episodes.max_turns x "
                                        "sampling.max_new_tokens), sampling.max_new_tokens or data.init_args.max_length")
        longest_prompt = getattr(datamodule, "longest_prompt", datamodule.longest)()
        max_new_tokens = self.sampling.max_new_tokens
        self.check_positions(longest_prompt + max_new_tokens,
                             f"the longest prompt ({longest_prompt} tokens) and sampling.max_new_tokens="
                             f"{max_new_tokens}", "lower sampling.max_new_tokens or data.init_args.max_length (longer "
                             "prompts are then skipped)")

    @property
    def samples_responses(self) -> bool:
        """Whether the module samples responses from the policy (DPO only in validation, and maybe not at all)."""
        return True

    @property
    def iteration(self) -> int:
        """Training batches completed before the current one (across epochs); 0 outside a fit."""
        return 0 if self._trainer is None else self.trainer.fit_loop.epoch_loop.total_batch_idx

    # ---- forward passes of any role ----------------------------------------------------------------------

    def token_logprobs(self, role: str | None, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                       with_entropy: bool = False, entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
        """``(log-probs [B, T], entropy [B, T] or None)`` of the tokens of ``input_ids`` under ``role`` at the
        sampling temperature, on the positions ``response_mask`` ``[B, T]`` marks, ``logprob_chunk`` positions at a
        time (see :func:`~rlhf_lightning.models.logprobs.token_logprobs`)."""
        return token_logprobs(self.model, role, input_ids, attention_mask, response_mask, self.sampling.temperature,
                              self.hparams.logprob_chunk, with_entropy=with_entropy, entropy_grad=entropy_grad)

    def response_logprobs(self, role: str | None, input_ids: Tensor, attention_mask: Tensor,
                          response_mask: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """:meth:`token_logprobs` of rollouts, whose responses are the last ``R`` columns: ``[B, R]`` each
        (``response_mask`` is ``[B, R]``)."""
        logprobs, entropy = self.token_logprobs(role, input_ids, attention_mask,
                                                pad_to_sequence(response_mask, input_ids.shape[1]), **kwargs)
        width = response_mask.shape[1]
        return logprobs[:, -width:], None if entropy is None else entropy[:, -width:]

    def response_hidden_states(self, role: str | None, input_ids: Tensor, attention_mask: Tensor,
                               response_mask: Tensor) -> Tensor:
        """Hidden states ``[B, R, H]`` of ``role`` at the positions that predict a rollout's response tokens."""
        hidden, _ = predicting_hidden_states(self.model, role, input_ids, attention_mask,
                                             pad_to_sequence(response_mask, input_ids.shape[1]))
        return hidden[:, -response_mask.shape[1]:]

    # ---- sampling ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Tensor, role: str | None = POLICY,
                 seeds: Sequence[int] | None = None, with_logprobs: bool = False, group: int = 1
                 ) -> tuple[Tensor, ...]:
        """Sample ``group`` responses to each prompt (consecutive rows), outside any rollout: ``(prompt + response
        ids, attention mask, response mask [B * group, R])``, and with ``with_logprobs`` the sampler's own
        log-probs ``[B * group, R]``. ``seeds``: one per response, each drawn from a generator of its own; None = the
        global random stream."""
        self.check_built()
        with self.sampler.gathered_base(self.model):
            drawn = self.sampler.draw(self.model, role, input_ids, attention_mask, group, seeds)
        sampled = (drawn.sequences, drawn.attention_mask, drawn.mask)
        return (*sampled, drawn.logprobs) if with_logprobs else sampled

    def check_built(self) -> None:
        """Refuse to sample before ``configure_model`` has built the model."""
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}'s model is not built: call configure_model() first (a "
                               "Trainer does when a fit, validation or test starts)")

    def decode(self, ids: Tensor, mask: Tensor) -> list[str]:
        """The texts of ``ids`` where ``mask`` is set, special tokens dropped."""
        return [self.tokenizer.decode(row[keep], skip_special_tokens=True)
                for row, keep in zip(ids, mask.bool(), strict=True)]

    # ---- optimizer, export ------------------------------------------------------------------------------

    def adapter_parameters(self, adapter: str) -> list[torch.nn.Parameter]:
        """The parameters of LoRA adapter ``adapter``, and of its head if it has one."""
        parameters = [p for name, p in self.model.model.named_parameters() if adapter_of(name) == adapter]
        if adapter in self.model.heads:
            parameters += list(self.model.heads[adapter].parameters())
        return parameters

    # ---- held-out prompts ----------------------------------------------------------------------------------

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.held_out.evaluate(batch, batch_idx)

    def evaluate_extra(self, rollout: Rollout, prompts: dict[str, Any], texts: list[str]) -> dict[str, Tensor]:
        """More per-sample validation values of a held-out rollout (``validation_metrics`` must name them), added by
        :class:`~rlhf_lightning.core.held_out.HeldOutSamples`; none here."""
        return {}

    def on_validation_epoch_start(self) -> None:
        self.held_out.start()
        super().on_validation_epoch_start()

    def on_validation_epoch_end(self) -> None:
        self.held_out.log()
        super().on_validation_epoch_end()

    def on_fit_end(self) -> None:
        if self.export_folder is not None:
            self.export(self.export_folder)

    def teardown(self, stage: str) -> None:
        if self._sampler is not None:
            self._sampler.close()  # vLLM's engine: its memory, and the process group it started
        if self._rollouts is not None:
            self._rollouts.close()  # the environment's: a server the fit started (OpenEnv's)
        super().teardown(stage)

    def export(self, directory: str | Path) -> dict[str, Path]:
        """Write the trained adapters (and their heads) in peft format under ``directory``. In a distributed fit
        every rank takes part (sharded adapters are gathered) and rank 0 writes.

        ``python -m rlhf_lightning merge --adapter DIR/policy --out MERGED`` makes a standalone model of the
        policy.
        """
        return {role: self.model.save_adapter(role, directory, write=self.is_writer) for role in self.exported_roles}
