"""The alternative for GRPO: TRL 1.16's ``GRPOTrainer`` with a LoRA policy (``peft_config``), as its documentation
sets it up, given the settings of our side (see ``grpo_vs_trl.py`` for every one that had to be aligned).

One model: the LoRA policy; at beta > 0 the reference is the same model with its adapters disabled (TRL does this
by itself for a new adapter), at beta = 0 TRL makes no reference pass. The reward is the same Python function as
ours (``harness.fixtures.even_token_reward``). With ``lora=False`` (the optional ``trl`` sides) the whole model is
trained and TRL loads a second copy as the reference at beta > 0.

An iteration is one generation batch (``prompts x group_size`` completions) and the ``ppo_epochs x num_minibatches``
optimizer steps TRL makes on it (``num_iterations x steps_per_generation``); its rollout is TRL's
``_generate_and_score_completions`` (generation, old and reference log-probs, rewards, advantages).

Under ``--lengths task`` or ``long-tail`` TRL stops at EOS (its own behaviour) and the policy's ``generate`` forces
the planned EOS of each row with the processor every side uses (``harness.lengths.force_stops_in_generate``).
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

from harness.fixtures import even_token_reward, peft_config, prompt_ids
from harness.lengths import StopPlan, force_stops_in_generate
from harness.measure import Stopwatch
from harness.processes import report
from harness.profiler import IterationProfiler
from harness.settings import GRPOSettings
from harness.sides import load_trl_side

TRL_VERSION = "1.16"


def grpo_config(settings: GRPOSettings, beta: float):
    """TRL's ``GRPOConfig`` computing what our GRPO computes (each choice documented in ``grpo_vs_trl.py``)."""
    from trl import GRPOConfig

    rows = settings.rollout_rows
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, seed=settings.seed, use_cpu=settings.device == "cpu",
        bf16=settings.precision == "bf16-mixed", fp16=False,
        gradient_checkpointing=settings.trl_gradient_checkpointing,
        # one generation batch of prompts x group completions, split into num_minibatches optimizer steps of one
        # micro-batch each, the whole of it passed over ppo_epochs times
        num_generations=settings.group_size, per_device_train_batch_size=rows // settings.num_minibatches,
        gradient_accumulation_steps=1, steps_per_generation=settings.num_minibatches,
        num_iterations=settings.ppo_epochs, max_steps=(settings.warmup + settings.iterations) * settings.optimizer_steps,
        # sampling: full distribution; under --lengths equal always the full length (EOS suppressed until
        # max_completion_length), else TRL's own stop at EOS, where the plan forces it (harness.lengths)
        max_completion_length=settings.response_length, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": settings.response_length} if settings.lengths == "equal" else None,
        # the objective
        beta=beta, loss_type="dapo", scale_rewards="group", epsilon=0.2, epsilon_high=None,
        importance_sampling_level="token", use_bias_correction_kl=True, mask_truncated_completions=False,
        top_entropy_quantile=1.0, entropy_coef=0.0, disable_dropout=True,
        # the optimizer
        learning_rate=settings.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
    )


def run(settings: GRPOSettings, beta: float, lora: bool = True, profile: bool = False) -> None:
    """TRL's ``GRPOTrainer`` at KL coefficient ``beta`` on the benchmark's prompts and reward (``lora``: a LoRA
    policy, else the whole model trained; ``profile``: the last iteration profiled); reports its measured
    iterations."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    tokenizer, policy = load_trl_side(settings, TRL_VERSION, "grpo_vs_trl.py")
    plan = StopPlan(settings)
    if settings.lengths != "equal":
        force_stops_in_generate(policy, plan)  # before peft wraps it: its generate reaches this one
    ids = prompt_ids(settings, settings.total_prompts)
    # Text prompts, as TRL takes them; the word-level tokenizer maps them back to exactly these ids.
    texts = tokenizer.batch_decode(ids)
    assert tokenizer(texts[:1])["input_ids"][0] == ids[0].tolist(), "prompt text does not round-trip to its ids"
    dataset = Dataset.from_dict({"prompt": texts})
    trainer = GRPOTrainer(
        model=policy, reward_funcs=even_token_reward, args=grpo_config(settings, beta), train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config(settings, policy) if lora else None,
    )
    watch = Stopwatch(settings.device)
    rows: list[dict[str, Any]] = []
    marks: dict[str, float] = {}

    original = trainer._generate_and_score_completions

    @functools.wraps(original)
    def timed_rollout(*args, **kwargs):
        result = original(*args, **kwargs)
        marks["rollout"] = watch.now() - marks["last"]
        return result

    trainer._generate_and_score_completions = timed_rollout

    profiler = IterationProfiler(settings.warmup + settings.iterations - 1 if profile else None)

    class IterationTimer(TrainerCallback):
        """An iteration ends at the ``on_step_end`` of its last optimizer step (``profile``: the last one is
        profiled)."""

        def on_train_begin(self, args, state, control, **kwargs):
            marks["last"] = watch.now()
            profiler.begin(0)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % settings.optimizer_steps:
                return
            now = watch.now()
            tokens = sum(plan.realised[-1]) if plan.realised else settings.rollout_rows * settings.response_length
            rows.append({"seconds": now - marks["last"], "rollout": marks.pop("rollout"), "tokens": float(tokens)})
            profiler.stop()
            profiler.begin(len(rows))
            marks["last"] = watch.now()

    trainer.add_callback(IterationTimer())
    trainer.train()
    lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history
               if "completions/mean_length" in entry]
    if settings.lengths == "equal" and any(length != settings.response_length for length in lengths):
        raise RuntimeError(f"TRL's completions were not all {settings.response_length} tokens long: mean lengths "
                           f"{lengths}")
    if settings.lengths != "equal" and len(plan.realised) != settings.warmup + settings.iterations:
        raise RuntimeError(f"TRL's generate forced the planned stops in {len(plan.realised)} rollouts, expected "
                           f"{settings.warmup + settings.iterations}")
    if len(rows) != settings.warmup + settings.iterations:
        raise RuntimeError(f"TRL ran {len(rows)} iterations, expected {settings.warmup + settings.iterations}")
    side = ("trl_lora" if lora else "trl") + ("" if beta else "_beta0")
    lengths = {"lengths": plan.realised} if plan.realised else {}
    report({"side": side, "iterations": rows[settings.warmup:], **lengths})
