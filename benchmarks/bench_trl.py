"""The alternative: TRL 1.12.0's ``PPOTrainer`` (``trl.experimental.ppo``) as its documentation sets it up.

Four separate models: the policy (a causal LM), the reference (a second copy; with ``peft_config`` none, the
policy's adapters are disabled instead), the value and the reward models (``AutoModelForSequenceClassification``
with one label, built from the same weights). With ``lora`` only the policy becomes a LoRA adapter, as in TRL.
Under ``--lengths task`` or ``long-tail`` its ``stop_token`` is ``eos`` and the policy's ``generate`` forces the
planned EOS of each row (``harness.lengths.force_stops_in_generate``), as on every side.
"""

from __future__ import annotations

import tempfile
from typing import Any

from harness.fixtures import model_dir, peft_config, prompt_ids
from harness.lengths import StopPlan, force_stops_in_generate
from harness.measure import Stopwatch
from harness.processes import report
from harness.settings import Settings
from harness.sides import load_trl_side

TRL_VERSION = "1.12"


def run(settings: Settings, lora: bool) -> None:
    """TRL's ``PPOTrainer`` on the benchmark's model and prompts (``lora``: a LoRA policy); reports its measured
    iterations."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback

    tokenizer, policy = load_trl_side(settings, TRL_VERSION, "ppo_vs_trl.py")  # before TRL 1.12's own imports
    plan = StopPlan(settings)
    if settings.lengths != "equal":
        force_stops_in_generate(policy, plan)  # before peft wraps it: its generate reaches this one
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    path = model_dir(settings)
    ref_policy = None if lora else AutoModelForCausalLM.from_pretrained(path)
    value_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    ids = prompt_ids(settings, settings.total_prompts)
    dataset = Dataset.from_dict({"input_ids": ids.tolist()})
    # TRL's rollout batch is per_device_train_batch_size x gradient_accumulation_steps, split into
    # num_mini_batches minibatches of per_device_train_batch_size.
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-ppo-"), report_to="none", save_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=settings.prompts // settings.num_minibatches,
        gradient_accumulation_steps=settings.num_minibatches, num_mini_batches=settings.num_minibatches,
        local_rollout_forward_batch_size=settings.prompts, num_ppo_epochs=settings.ppo_epochs,
        total_episodes=settings.total_prompts, response_length=settings.response_length,
        stop_token=None if settings.lengths == "equal" else "eos",
        temperature=1.0, learning_rate=settings.lr, num_sample_generations=0, seed=settings.seed,
        bf16=settings.precision == "bf16-mixed", use_cpu=settings.device == "cpu", logging_steps=1,
    )
    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=ref_policy, reward_model=reward_model,
        value_model=value_model, train_dataset=dataset, eval_dataset=dataset.select(range(settings.prompts)),
        peft_config=peft_config(settings, policy) if lora else None,
    )
    watch = Stopwatch(settings.device)
    rows: list[dict[str, Any]] = []
    marks: dict[str, float] = {}

    class IterationTimer(TrainerCallback):
        """An iteration ends at ``on_step_end``; its rollout ends at the first update forward (the policy+value
        wrapper is only called by the PPO epochs)."""

        def on_train_begin(self, args, state, control, **kwargs):
            marks["last"] = watch.now()

        def on_step_end(self, args, state, control, **kwargs):
            now = watch.now()
            tokens = sum(plan.realised[-1]) if plan.realised else settings.prompts * settings.response_length
            rows.append({"seconds": now - marks["last"], "rollout": marks.pop("rollout_end") - marks["last"],
                         "tokens": float(tokens)})
            marks["last"] = now

    def first_update_forward(module, args, kwargs):
        marks.setdefault("rollout_end", watch.now())

    trainer.model.register_forward_pre_hook(first_update_forward, with_kwargs=True)
    trainer.add_callback(IterationTimer())
    trainer.train()
    lengths = {"lengths": plan.realised} if plan.realised else {}
    report({"side": "trl_lora" if lora else "trl", "iterations": rows[settings.warmup:], **lengths})
