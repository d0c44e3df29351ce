"""Our side: ``rlhf_lightning.PPO`` (or ``GRPO``, ``DPO``) driven by a real ``lightning.Trainer``, exactly as users
run it (logger, checkpointing and progress bar off). PPO's four roles share one base: the policy and critic
adapters, the reference (adapters off) and the reward model (the ``reward`` adapter, ``AdapterReward``). GRPO has
the policy adapter and the reference (adapters off, only at beta > 0) and a reward function
(``harness.fixtures.even_token_reward``, ``FunctionReward``). DPO has the policy adapter and the reference (adapters
off), fed by a ``PreferenceDataModule`` reading the benchmark's pairs file."""

from __future__ import annotations

from typing import Any

import torch
from harness.fixtures import even_token_reward, lora_spec, model_dir, preference_path, prompt_ids, reward_dir
from harness.lengths import StopPlan
from harness.measure import Stopwatch
from harness.processes import report
from harness.profiler import IterationProfiler
from harness.settings import DPOSettings, GRPOSettings, Settings
from harness.sides import configure_threads


def make_callback(watch: Stopwatch, settings: Settings, profile: bool, prefix: str = "ppo"):
    """A callback timing each iteration (``prefix``: the module's metric prefix) and taking from ``watch`` the
    seconds of the phases it ran."""
    import lightning as L

    class IterationTimer(L.Callback):
        """Seconds between the ends of consecutive iterations (everything the loop does counts), and the split."""

        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []
            self.profiler = IterationProfiler(settings.warmup + settings.iterations - 1 if profile else None)

        def on_train_start(self, trainer, pl_module) -> None:
            watch.take()  # what ran before training (DPO's precomputed reference) is no iteration's
            self.last = watch.now()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.profiler.begin(batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = watch.now()
            metrics = trainer.callback_metrics
            row = {"seconds": now - self.last, "phases": watch.take()}
            if f"{prefix}/time/rollout" in metrics:  # the online algorithms: a rollout, then the update
                row["rollout"] = float(metrics[f"{prefix}/time/rollout"])
                row["tokens"] = float(metrics[f"{prefix}/response/length"]) * settings.rollout_rows
            self.rows.append(row)
            self.last = now
            self.profiler.stop()

    return IterationTimer()


def prompt_loader(settings: Settings, tokenizer):
    """The benchmark's prompts, ``prompts`` per batch, in the batches the online modules take."""
    ids = prompt_ids(settings, settings.total_prompts)
    texts = tokenizer.batch_decode(ids)

    def collate(rows: list[int]) -> dict[str, Any]:
        index = torch.tensor(rows)
        return {"prompts": {"input_ids": ids[index], "attention_mask": torch.ones_like(ids[index]),
                            "prompt": [texts[i] for i in rows]}}

    return torch.utils.data.DataLoader(list(range(len(ids))), batch_size=settings.prompts, collate_fn=collate)


def planned_stops(settings: Settings) -> tuple[StopPlan | None, dict[str, Any]]:
    """Under ``--lengths`` other than ``equal``: the plan, and the module argument of an engine that is our eager
    decoder (the one ``Auto`` picks on CPU) with the plan's :class:`~harness.lengths.ForcedStops` appended to its
    warpers, recording the lengths each rollout drew: an engine of our own, given as any user would. ``(None, {})``
    under ``equal``."""
    if settings.lengths == "equal":
        return None, {}
    from transformers import LogitsProcessorList

    from rlhf_lightning.rollout.decode import Decoder
    from rlhf_lightning.rollout.engines import EagerDecoder

    plan = StopPlan(settings)

    class StoppingDecoder(Decoder):
        def __call__(self, input_ids, attention_mask, warpers, *args, **kwargs):
            tokens, logprobs = super().__call__(input_ids, attention_mask,
                                                LogitsProcessorList([*warpers, plan.next_processor()]), *args, **kwargs)
            plan.record(tokens)
            return tokens, logprobs

    class StoppingEagerDecoder(EagerDecoder):
        def draw(self, model, *args, **kwargs):
            if self._decoder is None or self._decoder.hf_model is not model.hf_model:
                self._decoder = StoppingDecoder(model.hf_model, compiled=False)
            return super().draw(model, *args, **kwargs)

    return plan, {"engine": StoppingEagerDecoder()}


def stop_token(settings: Settings) -> str | None:
    """Our ``sampling.stop_token``: off under ``--lengths equal`` (every response the full length), else EOS."""
    return None if settings.lengths == "equal" else "eos"


# the modules' argument groups (rlhf_lightning.utils.checks.GROUP_CLASSES): dicts of some of their fields
GROUPS = ("sampling", "kl", "optimizer", "critic", "correction", "reward_shaping", "update", "episodes", "asynchronous",
          "loss")


def with_options(arguments: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """A module's ``arguments`` with the user's ``options`` (``--ppo-options`` and the like) over them; a group
    (``sampling``, ``kl``, ``optimizer``, ``update``, ``loss``, ...) is merged field by field, so that
    ``{"optimizer": {"adam_eps": 1e-5}}`` keeps the benchmark's learning rate."""
    merged = {**arguments, **options}
    for group in GROUPS:
        if isinstance(arguments.get(group), dict) and isinstance(options.get(group), dict):
            merged[group] = {**arguments[group], **options[group]}
    return merged


def lengths_of(plan: StopPlan | None) -> dict[str, Any]:
    """The result's ``lengths`` entry: each rollout's responses' lengths, where stops were planned."""
    return {} if plan is None else {"lengths": plan.realised}


def run(settings: Settings, profile: bool = False) -> None:
    """``rlhf_lightning.PPO``, its four roles on one base, with the settings TRL's ``PPOTrainer`` is given on the
    other side (see ``ppo_vs_trl.py``); reports its measured iterations."""
    configure_threads(settings)
    torch.manual_seed(settings.seed)
    plan, engine = planned_stops(settings)
    rows = fit(ppo_module(settings, **engine), settings, profile, "ppo")
    report({"side": "ours", "iterations": rows, **lengths_of(plan)})


def ppo_module(settings: Settings, samples_per_prompt: int = 1, **engine: Any):
    """The ``rlhf_lightning.PPO`` of :func:`run`, not yet fitted (``samples_per_prompt`` responses per prompt;
    ``engine``: the module's ``engine`` argument, where :func:`planned_stops` gives one)."""
    from rlhf_lightning import PPO, AdapterReward

    return PPO(**with_options(dict(
        base=base_spec(settings),
        reward=AdapterReward(str(reward_dir(settings))),
        policy_lora=lora_spec(settings),
        sampling={"max_new_tokens": settings.response_length, "temperature": 1.0, "stop_token": stop_token(settings)},
        samples_per_prompt=samples_per_prompt, update={"epochs": settings.ppo_epochs, "num_minibatches": settings.num_minibatches},
        optimizer={"lr": settings.lr}, critic={"lora": lora_spec(settings), "lr": settings.lr},
    ), settings.ppo_options), **engine)


def base_spec(settings: Settings):
    """The benchmark model as our base: fp32 weights, or bf16 weights under ``--precision bf16-true``."""
    from rlhf_lightning.models.spec import BaseModelSpec

    dtype = "bfloat16" if settings.precision == "bf16-true" else "float32"
    return BaseModelSpec(name_or_path=str(model_dir(settings)), dtype=dtype)


def fit(module, settings: Settings, profile: bool, prefix: str, datamodule=None,
        **trainer_options: Any) -> list[dict[str, Any]]:
    """Train ``module`` for ``warmup + iterations`` iterations under a real ``lightning.Trainer`` and return the
    measured iterations (after the warm-up), each with the seconds of the phases the library marked in it;
    ``prefix``: the module's metric prefix. The data: ``datamodule``, or else the benchmark's prompts;
    ``trainer_options``: further ``lightning.Trainer`` arguments."""
    import lightning as L

    watch = Stopwatch(settings.device)
    callback = make_callback(watch, settings, profile, prefix)
    trainer = L.Trainer(
        accelerator="gpu" if settings.device.startswith("cuda") else "cpu", devices=1,
        precision=settings.precision, max_epochs=1, limit_train_batches=settings.warmup + settings.iterations,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **trainer_options,
    )
    with watch.recording_phases():
        if datamodule is not None:
            trainer.fit(module, datamodule=datamodule)
        else:
            trainer.fit(module, train_dataloaders=prompt_loader(settings, module.tokenizer))
    return callback.rows[settings.warmup:]


def run_grpo(settings: GRPOSettings, beta: float, profile: bool = False) -> None:
    """``rlhf_lightning.GRPO`` at KL coefficient ``beta`` with the settings TRL's ``GRPOTrainer`` is given on the
    other side (see ``grpo_vs_trl.py``): k3 KL in the loss weighted by the ratio, token-mean loss over each
    optimizer step, group-std scaling with eps 1e-4, clip 0.2, gradient norm clipped to 1, constant learning rate."""
    configure_threads(settings)
    torch.manual_seed(settings.seed)
    plan, engine = planned_stops(settings)
    rows = fit(grpo_module(settings, beta, **engine), settings, profile, "grpo")
    report({"side": "ours" if beta else "ours_beta0", "iterations": rows, **lengths_of(plan)})


def grpo_module(settings: GRPOSettings, beta: float, **engine: Any):
    """The ``rlhf_lightning.GRPO`` of :func:`run_grpo`, not yet fitted (``engine``: as :func:`ppo_module`'s)."""
    from rlhf_lightning import GRPO, FunctionReward
    from rlhf_lightning.algorithms.advantage_estimators import GroupRelative
    from rlhf_lightning.algorithms.policy_losses import Clip

    return GRPO(**with_options(dict(
        base=base_spec(settings),
        reward=FunctionReward(even_token_reward),
        policy_lora=lora_spec(settings),
        sampling={"max_new_tokens": settings.response_length, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                  "stop_token": stop_token(settings)},
        samples_per_prompt=settings.group_size, advantages=GroupRelative(scale_rewards="group", std_eps=1e-4),
        kl={"coef": beta, "estimator": "k3", "added_to": "loss", "ratio_weighting": True},
        loss={"aggregation": "token_mean"},
        update={"epochs": settings.ppo_epochs, "num_minibatches": settings.num_minibatches, "max_grad_norm": 1.0},
        policy_loss=Clip(clip_range=0.2),
        optimizer={"lr": settings.lr, "adam_eps": 1e-8, "weight_decay": 0.0, "schedule": "constant"},
        seed=settings.seed,
    ), settings.ppo_options), **engine)


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
    from rlhf_lightning.algorithms.preference_losses import Sigmoid

    configure_threads(settings)
    torch.manual_seed(settings.seed)
    module = DPO(**with_options(dict(
        base=base_spec(settings), policy_lora=lora_spec(settings),
        beta=settings.beta, preference_loss=Sigmoid(label_smoothing=0.0), rpo_alpha=0.0,
        precompute_reference=settings.precompute, sample_eval_batches=0, sampling={"temperature": 1.0},
        optimizer={"lr": settings.lr, "weight_decay": 0.0, "warmup": 0, "schedule": "constant", "adam_eps": 1e-8},
        seed=settings.seed,
    ), settings.ppo_options))
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
    rows = fit(module, settings, profile, "dpo", datamodule=data, gradient_clip_val=1.0,
               gradient_clip_algorithm="norm")
    result: dict[str, Any] = {"side": "ours_precomputed" if settings.precompute else "ours", "iterations": rows,
                              "first_loss": float(first["loss"])}
    if settings.precompute:
        if "train" not in module.verified_splits:
            raise RuntimeError("precompute_reference was on, yet no reference table was computed")
        result["precompute"] = precompute["seconds"]
    report(result)
