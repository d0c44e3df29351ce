"""What the offline preference methods share (DPO's family, KTO): the policy adapter trained on given responses
against the reference (the same base with adapters disabled), automatic optimization, and validation that both
measures the method's own per-example values and samples from the policy as the online algorithms do.

A subclass defines :meth:`OfflinePreference.batch_losses`: the loss of a batch and its per-example values.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.core.policy import POLICY, Policy, hold_policy
from rlhf_lightning.core.stage import StageModule
from rlhf_lightning.models.shared_base import REFERENCE, SharedBase
from rlhf_lightning.rollout.rollouts import Rollout
from rlhf_lightning.utils import checks, compatibility
from rlhf_lightning.utils.optim import OptimizerSettings
from rlhf_lightning.utils.timing import phase


class OfflinePreference(StageModule):
    """The policy adapter optimised on fixed, labelled responses (pairs for DPO, single responses for KTO).

    The module holds its ``policy`` (:class:`~rlhf_lightning.core.policy.Policy`: the adapter, its sampler and
    log-probabilities), which takes the arguments it documents (``base``, ``policy_lora``, ``sampling``, ``engine``,
    ``logprob_chunk``, ``seed``, ``seed_scope``, ``sharded_rollout``, ``gold_reward``, ``pass_at_k``,
    ``export_dir``), and the evaluation of sampled responses on held-out prompts (``held_out``).

    Args:
        sample_eval_batches: sample responses on the prompts of the first N validation batches; null = all, 0 = no
            sampling (the method's own metrics only).
        optimizer: AdamW and its schedule for the policy adapter (``lr``, ``weight_decay``, ``warmup`` in optimizer
            steps, ``schedule``, ``adam_eps``, ``nonfinite``: see :class:`~rlhf_lightning.utils.optim.OptimizerSettings`).
    """

    exported_roles: tuple[str, ...] = (POLICY,)  # adapters written by ``export`` when the fit ends
    validation_metrics: tuple[str, ...] = ("kl", "length", "eos_frac", "gold")  # per-sample, averaged

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        compatibility.renamed_hooks(cls, compatibility.MOVED_TO_POLICY, "the module")  # now the policy's

    def __init__(
        self,
        *args: Any,
        sample_eval_batches: int | None = None,
        optimizer: OptimizerSettings = StageModule.default_optimizer,
        **kwargs: Any,
    ) -> None:
        policy = Policy(*args, **kwargs)
        super().__init__(policy.base)
        hold_policy(self, policy, inspect.currentframe())  # self.policy, self.sampling, self.held_out
        checks.at_least("sample_eval_batches", sample_eval_batches, minimum=0, optional=True)
        self.optimizer_settings = self.keep_group("optimizer", optimizer, self.default_optimizer)

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads the reference's log-probs."""
        return True

    @property
    def samples_responses(self) -> bool:
        """Whether validation samples responses from the policy (``sample_eval_batches`` not 0)."""
        return self.hparams.sample_eval_batches != 0

    def build_model(self, empty: bool) -> SharedBase:
        return self.policy.build(self.load_base(empty=empty))

    def setup(self, stage: str) -> None:
        if self.samples_responses:
            self.policy.prepare(self._trainer)  # the engine's refusal and the stop token, before the model is built
        else:
            self.policy.sampler  # noqa: B018 (a stop_token the tokenizer lacks fails here, before the model is built)
        super().setup(stage)

    def check_lengths(self, datamodule: Any) -> None:
        super().check_lengths(datamodule)  # the pairs themselves
        if self.samples_responses:
            self.policy.check_reach(datamodule)  # their prompts and the responses sampled after them

    def teardown(self, stage: str) -> None:
        self.policy.close()
        super().teardown(stage)

    # ---- log-probs ----------------------------------------------------------------------------------------

    def sequence_logps(self, role: str | None, batch: dict[str, Tensor]) -> Tensor:
        """Log-probs of each row's response summed over its tokens (``response_mask``): ``[rows]``."""
        mask = batch["response_mask"]
        logprobs, _ = self.policy.token_logprobs(role, batch["input_ids"], batch["attention_mask"], mask)
        return torch.where(mask, logprobs, 0.0).sum(-1)

    def reference_logps(self, batch: dict[str, Tensor], split: str) -> Tensor | None:
        """The reference's :meth:`sequence_logps` of every row (one no-grad pass); None without a reference."""
        if not self.needs_reference:
            return None
        with torch.no_grad(), phase("update/reference forward"):
            return self.sequence_logps(REFERENCE, batch)

    # ---- the loss: what a subclass defines ----------------------------------------------------------------

    def batch_losses(self, batch: dict[str, Tensor], split: str) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss to minimise, detached per-example values named as in validation_metrics)`` of ``batch``."""
        raise NotImplementedError

    def guarded_values(self, loss: Tensor, values: dict[str, Tensor]) -> dict[str, Tensor]:
        """What the non-finite guard checks in a training step (named as it will report them)."""
        return {f"{self.metric_prefix}/loss": loss}

    def training_means(self, values: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Each per-example value's mean over the examples of every rank that have it (its sum and count summed
        over ranks: every rank gets the global batch's mean, even one holding none of those examples); a value no
        rank has is left out."""
        names = list(values)
        sums = self.ranks.sum(torch.stack([values[name].float().sum() for name in names]))
        counts = self.ranks.sum(torch.tensor([float(values[name].numel()) for name in names],
                                                  device=sums.device))
        return {name: sums[i] / count for i, (name, count) in enumerate(zip(names, counts.tolist(), strict=True))
                if count > 0}

    def log_training(self, values: dict[str, Tensor], batch: dict[str, Tensor]) -> None:
        """Log a training batch: :meth:`training_means`, the learning rate, and :meth:`progress_bar`'s values."""
        examples = batch["index"].shape[0]
        means = self.training_means(values, batch)
        self.log_dict({f"{self.metric_prefix}/{name}": mean for name, mean in means.items()}, batch_size=examples)
        self.log(f"{self.metric_prefix}/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log_dict(self.progress_bar(means), prog_bar=True, logger=False, batch_size=examples)

    def progress_bar(self, means: dict[str, Tensor]) -> dict[str, Tensor]:
        """What the progress bar shows of a training batch (from :meth:`training_means`)."""
        return {"loss": means["loss"]}

    # ---- Lightning hooks ----------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, values = self.batch_losses(batch, "train")
        self.guard_losses(self.guarded_values(loss, values))
        self.log_training(values, batch)
        return loss

    def evaluate_extra(self, rollout: Rollout, prompts: dict[str, Any], texts: list[str]) -> dict[str, Tensor]:
        """More per-sample values of a held-out rollout (name them in ``validation_metrics``), added by
        ``held_out``: none here."""
        return {}

    def on_validation_epoch_start(self) -> None:
        self.held_out.start()

    def on_validation_epoch_end(self) -> None:
        self.held_out.log()
        super().on_validation_epoch_end()

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        _, values = self.batch_losses(batch, "val")
        self.held_out.record(values)
        limit = self.hparams.sample_eval_batches
        prompt_ids, prompt_mask = batch["prompt_input_ids"], batch["prompt_attention_mask"]
        # Generation needs at least one prompt token (transcript-only pairs may share no beginning).
        if (limit is None or batch_idx < limit) and bool(prompt_mask.sum(-1).min() > 0):
            self.held_out.evaluate({"input_ids": prompt_ids, "attention_mask": prompt_mask,
                                   "prompt": self.policy.decode(prompt_ids, prompt_mask), "index": batch["index"]},
                                  batch_idx)

    def configure_optimizers(self):
        settings = self.optimizer_settings
        parameters = self.model.adapter_parameters(POLICY)
        return self.configure_adamw([{"name": POLICY, "params": parameters, "lr": settings.lr}], settings)
