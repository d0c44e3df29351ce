"""The policy of a stage, a component: a LoRA adapter on the one frozen base whose adapters-disabled view is the
reference model.

What every policy-optimising stage holds (the online RL family, DPO and KTO) as its ``policy``: the ``policy``
adapter's settings, log-probabilities of any role from a response mask (left-padded rollouts and right-padded
preference pairs alike), its sampler and turn loop (:mod:`rlhf_lightning.rollout`), and what the evaluation of
sampled responses on held-out prompts reads (the gold reward, pass@k). The module that holds it builds the model,
loads the tokenizer and wires the Lightning hooks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.parsing import collect_init_args
from torch import Tensor

from rlhf_lightning.core.distributed import sharding_mesh
from rlhf_lightning.core.held_out import POLICY, HeldOutSamples
from rlhf_lightning.core.held_out_pass_at_k import PassAtK, answer_reader
from rlhf_lightning.models.loading import check_positions
from rlhf_lightning.models.logprobs import predicting_hidden_states, token_logprobs
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.rollout.engines import Auto, Engine, EngineSetup
from rlhf_lightning.rollout.rollouts import Rollouts
from rlhf_lightning.rollout.sampler import Sampler
from rlhf_lightning.rollout.seeds import Seeds
from rlhf_lightning.rollout.settings import Episodes, Sampling
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


class Policy:
    """The trained policy of a stage: the ``policy`` LoRA adapter on the base, whose adapters-disabled view is the
    reference, how its responses are drawn, and the log-probabilities of any role at its sampling temperature.

    The module that holds it (:meth:`attach`) builds the model and loads the tokenizer, which this reads.

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

    default_sampling = Sampling()  # the ``sampling`` a dict of some of its fields is taken over

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
        self.base = base
        self.lora = without_dropout(policy_lora.check("policy_lora"), POLICY)
        self.sampling: Sampling = checks.group_settings("sampling", sampling, self.default_sampling)
        self.engine = engine
        self.logprob_chunk, self.seed, self.seed_scope = logprob_chunk, seed, seed_scope
        self.sharded_rollout = sharded_rollout
        self.gold_reward = gold_reward
        self.pass_at_k = pass_at_k.check()
        if pass_at_k.enabled and gold_reward is None:
            raise ValueError(f"pass_at_k.samples={pass_at_k.samples} needs gold_reward: pass@k and maj@k count the "
                             "responses a verifier judges correct (e.g. rlhf_lightning.tasks.arithmetic.exact_match)")
        self.export_dir = export_dir
        self.episodes: Episodes | None = None  # multi-turn episodes of an online module (see use_episodes)
        self.stage: Any = None  # the module holding it (attach): its model and tokenizer
        self._sampler: Sampler | None = None
        self._rollouts: Rollouts | None = None

    def refuse_truncated_sampling(self) -> None:
        """Refuse top-k or top-p sampling for a module that trains on its own samples: its losses and KL use
        log-probs of the full distribution (at the temperature), so every ratio and KL would be wrong."""
        if self.sampling.top_k or self.sampling.top_p < 1.0:
            raise ValueError("sampling.top_k/top_p: the losses and the KL use log-probs of the full distribution (at "
                             "the temperature), so sampling from a truncated one would make every ratio and KL wrong; "
                             "set sampling.top_k: 0, sampling.top_p: 1.0")

    def attach(self, stage: Any) -> Policy:
        """Read the model and tokenizer of ``stage``, the module that holds this policy; returns itself."""
        self.stage = stage
        return self

    def use_episodes(self, episodes: Episodes) -> None:
        """Run :attr:`rollouts` as ``episodes`` say (an online module's; the environment null = single turns)."""
        self.episodes = episodes

    @property
    def model(self) -> SharedBase | None:
        """The holding module's model (None until its ``configure_model``)."""
        return self.stage.model

    @property
    def tokenizer(self):
        """The holding module's tokenizer."""
        return self.stage.tokenizer

    def build(self, model: SharedBase) -> SharedBase:
        """``model`` with the policy adapter added."""
        model.add_adapter(POLICY, self.lora)
        return model

    @property
    def sampler(self) -> Sampler:
        """What draws the policy's responses: the sampling settings (stop tokens from the tokenizer), the seeds, the
        engine and the sharded base's gathering."""
        if self._sampler is None:
            self._sampler = Sampler(self.sampling.settings(self.tokenizer), Seeds(self.seed, self.seed_scope),
                                    self.tokenizer.pad_token_id, self.sharded_rollout, self.engine)
        return self._sampler

    @property
    def rollouts(self) -> Rollouts:
        """The turn loop of the policy's rollouts: single-turn, or the episodes of :meth:`use_episodes`."""
        if self._rollouts is None:
            episodes = self.episodes
            self._rollouts = Rollouts(self.sampler, self.tokenizer) if episodes is None else Rollouts(
                self.sampler, self.tokenizer, episodes.environment, episodes.max_turns, episodes.max_tokens)
        return self._rollouts

    def prepare(self, trainer: Any) -> None:
        """Before the model is built: what the engine cannot serve (:meth:`Engine.refusal`), in one line; then the
        engine keeps what it needs of the setup (:meth:`Engine.prepare`). A stop token the tokenizer lacks fails
        here too."""
        self.sampler  # noqa: B018 (its settings read the stop token)
        setup = EngineSetup(device_type=trainer.strategy.root_device.type if trainer is not None else "cpu",
                            sharded=sharding_mesh(trainer) is not None, kv_cache=self.sampling.kv_cache,
                            name_or_path=self.base.name_or_path, adapters={POLICY: self.lora},
                            run_folder=None if trainer is None else str(trainer.default_root_dir))
        refusal = self.engine.refusal(setup)
        if refusal is not None:
            raise ValueError(refusal)
        self.engine.prepare(setup)

    def check_reach(self, datamodule: Any) -> None:
        """Prompts and the responses sampled after them must fit the model's positions; with an environment, every
        position a turn can reach: the longest prompt's opening (the chat template's markers and the tools' schemas
        included) and the episode, whose last turn can start one token before the budget and decode
        ``sampling.max_new_tokens``."""
        def check(tokens: int, what: str, fix: str) -> None:
            check_positions(self.base, self.tokenizer, tokens, what, fix)

        if self.rollouts.environment is not None:
            examples = [*(datamodule.train_set or []), *datamodule.val_set]
            longest = max(examples, key=datamodule.length)
            reach = self.rollouts.reach(longest.raw if longest.raw is not None else longest.text)
            return check(*reach, "lower episodes.max_tokens (null = episodes.max_turns x sampling.max_new_tokens), "
                         "sampling.max_new_tokens or data.init_args.max_length")
        longest_prompt = getattr(datamodule, "longest_prompt", datamodule.longest)()
        max_new_tokens = self.sampling.max_new_tokens
        check(longest_prompt + max_new_tokens,
              f"the longest prompt ({longest_prompt} tokens) and sampling.max_new_tokens={max_new_tokens}",
              "lower sampling.max_new_tokens or data.init_args.max_length (longer prompts are then skipped)")

    # ---- forward passes of any role ----------------------------------------------------------------------

    def token_logprobs(self, role: str | None, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                       with_entropy: bool = False, entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
        """``(log-probs [B, T], entropy [B, T] or None)`` of the tokens of ``input_ids`` under ``role`` at the
        sampling temperature, on the positions ``response_mask`` ``[B, T]`` marks, ``logprob_chunk`` positions at a
        time (see :func:`~rlhf_lightning.models.logprobs.token_logprobs`)."""
        return token_logprobs(self.model, role, input_ids, attention_mask, response_mask, self.sampling.temperature,
                              self.logprob_chunk, with_entropy=with_entropy, entropy_grad=entropy_grad)

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
            raise RuntimeError(f"{type(self.stage).__name__}'s model is not built: call configure_model() first (a "
                               "Trainer does when a fit, validation or test starts)")

    def decode(self, ids: Tensor, mask: Tensor) -> list[str]:
        """The texts of ``ids`` where ``mask`` is set, special tokens dropped."""
        return [self.tokenizer.decode(row[keep], skip_special_tokens=True)
                for row, keep in zip(ids, mask.bool(), strict=True)]

    def close(self) -> None:
        """Let go of the engine (vLLM's: its memory, and the process group it started) and of the turn loop's
        environment (a server the fit started: OpenEnv's)."""
        if self._sampler is not None:
            self._sampler.close()
        if self._rollouts is not None:
            self._rollouts.close()

    # ---- what the holding module saves and logs ------------------------------------------------------------

    @property
    def arguments(self) -> dict[str, Any]:
        """The policy's arguments, for the module's hyper-parameters: as resolved (``sampling`` over its defaults,
        ``policy_lora`` with its dropout at 0)."""
        return {"base": self.base, "policy_lora": self.lora, "sampling": self.sampling, "engine": self.engine,
                "logprob_chunk": self.logprob_chunk, "seed": self.seed, "seed_scope": self.seed_scope,
                "sharded_rollout": self.sharded_rollout, "gold_reward": self.gold_reward,
                "pass_at_k": self.pass_at_k, "export_dir": self.export_dir}

    def validation_names(self, metrics: Sequence[str]) -> list[str]:
        """The per-sample values held-out evaluation averages: the module's ``metrics`` and pass@k's."""
        names = [*metrics]
        if self.pass_at_k.enabled:
            names += self.pass_at_k.metric_names(with_majority=answer_reader(self.gold_reward) is not None)
        return names


NOT_SAVED = ("reward", "gold_reward", "episodes", "engine")  # objects and code: not in the hyper-parameters


def hold_policy(module: Any, policy: Policy, frame: FrameType | None) -> None:
    """Wire ``policy`` into ``module``, a policy-optimising stage, in its ``__init__`` after the stage base's
    (``frame``: that ``__init__``'s frame): the module's hyper-parameters (:func:`save_arguments`; ``sampling``
    saved plain), the policy as ``module.policy``, its sampling settings as ``module.sampling``, and the evaluation
    of its samples on held-out prompts as ``module.held_out`` (of the module's ``validation_metrics`` and pass@k's;
    its metrics registered on the module, so that they move to its device)."""
    save_arguments(module, frame, policy)
    module.policy = policy.attach(module)
    module.sampling = module.keep_group("sampling", policy.sampling, policy.default_sampling)
    module.held_out = HeldOutSamples(module, policy.validation_names(module.validation_metrics),
                                     gold=policy.gold_reward is not None)
    module.val_metrics, module.val_gold_spread = module.held_out.metrics, module.held_out.gold_spread


def save_arguments(module: Any, frame: FrameType | None, policy: Policy) -> None:
    """Save ``module``'s hyper-parameters (called in its ``__init__``, ``frame`` its frame): under LightningCLI the
    config's, else its constructors' arguments; then what they lack: each ``__init__`` level's own arguments from
    ``frame`` up (what a subclass passes to its parent itself, e.g. PPO(gamma=0.99) fixed in a subclass) and the
    policy's."""
    module.save_hyperparameters(ignore=list(NOT_SAVED), frame=frame)
    for level in [*collect_init_args(frame, []), policy.arguments]:
        module.hparams.update({name: value for name, value in level.items()
                               if name not in module.hparams and name not in NOT_SAVED})
