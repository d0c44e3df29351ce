"""Fits of the on-policy modules on a base whose responses stop at varied lengths, and the tolerances of their comparisons."""

from __future__ import annotations

import lightning as L
import torch

from rlhf_lightning import FunctionReward
from rlhf_lightning.core.online import OnlineRL
from rlhf_lightning.models.shared_prompt import cache_keyword
from rlhf_lightning.tasks.synthetic import gold_rewards
from tests.helpers.modules import make, merged
from tests.helpers.online import Recorder, perturb, prompts

TOLERANCE = dict(rtol=1e-6, atol=1e-6)  # one pass


FIT_TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # losses and gradients of a fit after its first step


WEIGHT_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def make_stopping(cls: type[OnlineRL], model_dir, **arguments) -> OnlineRL:
    """``cls`` on the tiny base whose responses stop at varied lengths, scored by the synthetic task's gold reward
    (4 responses per prompt; online DPO's pair)."""
    return make(cls, model_dir, FunctionReward(gold_rewards), dict(sampling={"max_new_tokens": 12}, samples_per_prompt=4),
                **arguments)


class Gradients(L.Callback):
    """The gradient of every trainable parameter before every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()
                           if p.grad is not None})


def fit(cls, model_dir, tmp_path, **options) -> dict:
    """Two iterations of two epochs, one minibatch each (so the update's minibatch is the whole rollout, as narrow
    as its rows): the logged rows, each step's gradients, the trained weights and the widths of the update's
    forward passes."""
    module = make_stopping(cls, model_dir, **merged({"update": {"epochs": 2, "num_minibatches": 1}}, options))
    perturb(module, "policy", "critic")
    widths: list[int] = []
    decoder = module.model.hf_model.get_decoder()
    cache = cache_keyword(decoder)

    def record_width(layer, args, kwargs) -> None:
        # the rows' columns: a whole-row pass's mask, or that of the responses' pass after their shared prompt (its
        # mask covers the prompt too); the shared prompt's own pass (a cache made, none given) is not a width
        if torch.is_grad_enabled() and not (kwargs.get("use_cache") and kwargs.get(cache) is None):
            widths.append(kwargs["attention_mask"].shape[1])

    decoder.register_forward_pre_hook(record_width, with_kwargs=True)
    recorder, gradients = Recorder(f"{module.metric_prefix}/"), Gradients()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, log_every_n_steps=1, callbacks=[recorder, gradients],
                        default_root_dir=tmp_path)
    trainer.fit(module, datamodule=prompts(module, n=8, batch_size=4))
    return {"rows": recorder.rows, "gradients": gradients.steps, "widths": widths,
            "weights": {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}}
