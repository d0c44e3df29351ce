"""Our side: ``rlhf_lightning.PPO`` (or ``GRPO``, ``DPO``) driven by a real ``lightning.Trainer``, exactly as users
run it (logger, checkpointing and progress bar off). PPO's four roles share one base: the policy and critic
adapters, the reference (adapters off) and the reward model (the ``reward`` adapter, ``AdapterReward``). GRPO has
the policy adapter and the reference (adapters off, only at beta > 0) and a reward function
(``bench_common.even_token_reward``, ``FunctionReward``). DPO has the policy adapter and the reference (adapters
off), fed by a ``PreferenceDataModule`` reading the benchmark's pairs file."""

from __future__ import annotations

import functools
from typing import Any

import torch
from bench_common import (
    DPOSettings,
    GRPOSettings,
    IterationProfiler,
    Settings,
    Stopwatch,
    configure_threads,
    even_token_reward,
    lora_spec,
    model_dir,
    preference_path,
    prompt_ids,
    report,
    reward_dir,
    total_prompts,
)

# (method, its name when called without gradients, its name with them)
ONLINE_PHASES = (
    ("generate", "rollout/generate", "rollout/generate"),
    ("response_logprobs", "rollout/logprobs (policy, reference)", "update/policy forward"),
    ("response_values", "rollout/values (critic)", "update/critic forward"),
    ("score_responses", "rollout/reward", "rollout/reward"),
    ("manual_backward", "update/backward", "update/backward"),
)
DPO_PHASES = (
    ("sequence_logps", "reference forward", "policy forward"),
    ("backward", "backward", "backward"),
)


class PhaseTimer:
    """Wall-clock time of each piece of our iteration, by wrapping the module's own methods (no code change);
    ``phases``: which methods, and what to call them (see ``ONLINE_PHASES``)."""

    def __init__(self, module, device: str, phases=ONLINE_PHASES) -> None:
        self.watch = Stopwatch(device)
        self.module = module
        for method, rollout_name, update_name in phases:
            self._wrap(method, rollout_name, update_name)

    def _wrap(self, method: str, rollout_name: str, update_name: str) -> None:
        original = getattr(self.module, method, None)
        if original is None:  # e.g. no critic in GRPO
            return

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = self.watch.now()
            result = original(*args, **kwargs)
            self.watch.add(update_name if torch.is_grad_enabled() else rollout_name, self.watch.now() - start)
            return result

        setattr(self.module, method, timed)

    def attach_optimizer(self, optimizer) -> None:
        state = {}

        def pre_hook(optimizer, args, kwargs):
            state["start"] = self.watch.now()
            closure = kwargs.get("closure")
            if closure is None:  # manual optimization: the step is the update alone
                return None

            def timed_closure():  # automatic optimization: the step runs forward and backward first
                result = closure()
                state["start"] = self.watch.now()
                return result

            return args, {**kwargs, "closure": timed_closure}

        optimizer.register_step_pre_hook(pre_hook)
        optimizer.register_step_post_hook(
            lambda *_: self.watch.add("update/optimizer step", self.watch.now() - state["start"]))

    def take(self) -> dict[str, float]:
        seconds, self.watch.seconds = self.watch.seconds, {}
        return seconds


def make_callback(timer: PhaseTimer, settings: Settings, profile: bool, prefix: str = "ppo"):
    import lightning as L

    class IterationTimer(L.Callback):
        """Seconds between the ends of consecutive iterations (everything the loop does counts), and the split."""

        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []
            self.profiler = IterationProfiler(settings.warmup + settings.iterations - 1 if profile else None)

        def on_train_start(self, trainer, pl_module) -> None:
            timer.attach_optimizer(trainer.optimizers[0].optimizer
                                   if hasattr(trainer.optimizers[0], "optimizer") else trainer.optimizers[0])
            timer.take()  # what ran before training (DPO's precomputed reference) is no iteration's
            self.last = timer.watch.now()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.profiler.begin(batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = timer.watch.now()
            metrics = trainer.callback_metrics
            row = {"seconds": now - self.last, "phases": timer.take()}
            if f"{prefix}/time/rollout" in metrics:  # the online algorithms: a rollout, then the update
                row["rollout"] = float(metrics[f"{prefix}/time/rollout"])
                row["tokens"] = float(metrics[f"{prefix}/response/length"]) * settings.rollout_rows
            self.rows.append(row)
            self.last = now
            self.profiler.stop()

    return IterationTimer()


def prompt_loader(settings: Settings, tokenizer):
    ids = prompt_ids(settings, total_prompts(settings))
    texts = tokenizer.batch_decode(ids)

    def collate(rows: list[int]) -> dict[str, Any]:
        index = torch.tensor(rows)
        return {"prompts": {"input_ids": ids[index], "attention_mask": torch.ones_like(ids[index]),
                            "prompt": [texts[i] for i in rows]}}

    return torch.utils.data.DataLoader(list(range(len(ids))), batch_size=settings.prompts, collate_fn=collate)


def run(settings: Settings, profile: bool = False) -> None:
    from rlhf_lightning import PPO, AdapterReward

    configure_threads(settings)
    torch.manual_seed(settings.seed)
    module = PPO(
        base=base_spec(settings),
        reward=AdapterReward(str(reward_dir(settings))),
        policy_lora=lora_spec(settings), critic_lora=lora_spec(settings),
        max_new_tokens=settings.response_length, temperature=1.0, stop_token=None,
        epochs=settings.ppo_epochs, num_minibatches=settings.num_minibatches,
        policy_lr=settings.lr, critic_lr=settings.lr,
        **settings.ppo_options,
    )
    rows = fit(module, settings, profile, "ppo")
    report({"side": "ours", "iterations": rows})


def base_spec(settings: Settings):
    """The benchmark model as our base: fp32 weights, or bf16 weights under ``--precision bf16-true``."""
    from rlhf_lightning.models.spec import BaseModelSpec

    dtype = "bfloat16" if settings.precision == "bf16-true" else "float32"
    return BaseModelSpec(name_or_path=str(model_dir(settings)), dtype=dtype)


def fit(module, settings: Settings, profile: bool, prefix: str, datamodule=None, phases=ONLINE_PHASES,
        **trainer_options: Any) -> list[dict[str, Any]]:
    """Train ``module`` for ``warmup + iterations`` iterations under a real ``lightning.Trainer`` and return the
    measured iterations (after the warm-up); ``prefix``: the module's metric prefix. The data: ``datamodule``, or
    else the benchmark's prompts; ``trainer_options``: further ``lightning.Trainer`` arguments."""
    import lightning as L

    timer = PhaseTimer(module, settings.device, phases)
    callback = make_callback(timer, settings, profile, prefix)
    trainer = L.Trainer(
        accelerator="gpu" if settings.device.startswith("cuda") else "cpu", devices=1,
        precision=settings.precision, max_epochs=1, limit_train_batches=settings.warmup + settings.iterations,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **trainer_options,
    )
    if datamodule is not None:
        trainer.fit(module, datamodule=datamodule)
    else:
        trainer.fit(module, train_dataloaders=prompt_loader(settings, module.tokenizer))
    return callback.rows[settings.warmup:]


def run_grpo(settings: GRPOSettings, beta: float, profile: bool = False) -> None:
    """``rlhf_lightning.GRPO`` at KL coefficient ``beta`` with the settings TRL's ``GRPOTrainer`` is given on the
    other side (see ``grpo_vs_trl.py``): k3 KL in the loss weighted by the ratio, token-mean loss over each
    optimizer step, group-std scaling with eps 1e-4, clip 0.2, gradient norm clipped to 1, constant learning rate."""
    from rlhf_lightning import GRPO, FunctionReward

    configure_threads(settings)
    torch.manual_seed(settings.seed)
    module = GRPO(
        base=base_spec(settings),
        reward=FunctionReward(even_token_reward),
        policy_lora=lora_spec(settings),
        max_new_tokens=settings.response_length, temperature=1.0, top_k=0, top_p=1.0, stop_token=None,
        samples_per_prompt=settings.group_size, scale_rewards="group", std_eps=1e-4,
        kl_coef=beta, kl_estimator="k3", kl_in="loss", kl_ratio_weighting=True, loss_aggregation="token_mean",
        epochs=settings.ppo_epochs, num_minibatches=settings.num_minibatches, clip_range=0.2,
        clip_range_high=None, max_grad_norm=1.0, policy_lr=settings.lr, adam_eps=1e-8, weight_decay=0.0,
        lr_schedule="constant", seed=settings.seed,
        **settings.ppo_options,
    )
    rows = fit(module, settings, profile, "grpo")
    report({"side": "ours" if beta else "ours_beta0", "iterations": rows})


def run_dpo(settings: DPOSettings, profile: bool = False) -> None:
    """``rlhf_lightning.DPO`` with the settings TRL's ``DPOTrainer`` is given on the other side (see
    ``dpo_vs_trl.py``): sigmoid loss at ``beta``, no label smoothing, log-probs summed over the response tokens,
    AdamW at a constant learning rate, gradient norm clipped to 1 (the Trainer's ``gradient_clip_val``), the
    reference = adapters off, per step or (``settings.precompute``) once for every pair when ``fit`` starts.

    With ``precompute`` the result carries ``precompute``: the seconds of ``DPO.on_fit_start`` (the fingerprint of
    the pairs and the reference pass over all of them, in batches of ``prompts`` pairs), outside every iteration.
    ``first_loss``: the loss of the first step, ln 2 when the reference is the base (the new adapter adds zero)."""
    import time

    from rlhf_lightning import DPO, PreferenceDataModule

    configure_threads(settings)
    torch.manual_seed(settings.seed)
    module = DPO(
        base=base_spec(settings), policy_lora=lora_spec(settings),
        beta=settings.beta, loss_type="sigmoid", label_smoothing=0.0, rpo_alpha=0.0,
        precompute_reference=settings.precompute, sample_eval_batches=0, temperature=1.0,
        lr=settings.lr, weight_decay=0.0, warmup_steps=0, lr_schedule="constant", adam_eps=1e-8, seed=settings.seed,
        **settings.ppo_options,
    )
    data = PreferenceDataModule(
        dataset=str(preference_path(settings)), val_fraction=0.0, batch_size=settings.prompts,
        val_batch_size=settings.prompts, max_length=settings.max_length, on_too_long="error", seed=settings.seed,
    )
    precompute: dict[str, float] = {}
    original = module.on_fit_start

    def timed_on_fit_start() -> None:
        lengths = {(len(p.chosen_ids), len(p.rejected_ids), p.prompt_length) for p in data.train_set}
        expected = {(settings.prompt_length + settings.response_length,
                     settings.prompt_length + settings.rejected_length, settings.prompt_length)}
        if lengths != expected or len(data.train_set) != settings.prompts * settings.steps:
            raise RuntimeError(f"our pairs are not the benchmark's: lengths {lengths}, {len(data.train_set)} pairs")
        start = time.perf_counter()
        original()
        if settings.device.startswith("cuda"):
            torch.cuda.synchronize()
        precompute["seconds"] = time.perf_counter() - start

    module.on_fit_start = timed_on_fit_start
    first: dict[str, torch.Tensor] = {}
    training_step = module.training_step

    def first_loss_kept(batch, batch_idx):
        loss = training_step(batch, batch_idx)
        first.setdefault("loss", loss.detach())  # no device sync here: read after training
        return loss

    module.training_step = first_loss_kept
    rows = fit(module, settings, profile, "dpo", datamodule=data, phases=DPO_PHASES, gradient_clip_val=1.0,
               gradient_clip_algorithm="norm")
    result: dict[str, Any] = {"side": "ours_precomputed" if settings.precompute else "ours", "iterations": rows,
                              "first_loss": float(first["loss"])}
    if settings.precompute:
        if "train" not in module.verified_splits:
            raise RuntimeError("precompute_reference was on, yet no reference table was computed")
        result["precompute"] = precompute["seconds"]
    report(result)
