"""The alternative for DPO: TRL 1.16's ``DPOTrainer`` with a LoRA policy (``peft_config``), as its documentation
sets it up, given the settings of our side (see ``dpo_vs_trl.py`` for every one that had to be aligned).

One model: the LoRA policy; the reference is the same model with its adapters disabled (TRL does this by itself for
a new adapter), per step, or once for every pair before training with ``precompute_ref_log_probs``. With
``lora=False`` (the optional ``trl`` sides) the whole model is trained and TRL loads a second copy as the
reference (without precomputing; with it, the policy itself serves, before training starts).

An iteration is one optimizer step (one batch of ``prompts`` pairs); iterations are timed from the end of one
``on_step_end`` to the next, the first from ``on_train_begin``. TRL precomputes inside ``DPOTrainer.__init__``:
that pass is timed on its own (``precompute``: the hash of the reference weights TRL keys its cache with, and
``_precompute_ref_logps`` over the training pairs) and is in no iteration.
"""

from __future__ import annotations

import tempfile
from typing import Any

from harness.fixtures import lora_spec, read_preference_pairs
from harness.measure import Stopwatch
from harness.processes import report
from harness.profiler import IterationProfiler
from harness.settings import DPOSettings
from harness.sides import load_trl_side

TRL_VERSION = "1.16"


def dpo_config(settings: DPOSettings):
    """TRL's ``DPOConfig`` computing what our DPO computes (each choice documented in ``dpo_vs_trl.py``)."""
    from trl import DPOConfig

    return DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-dpo-"), report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, seed=settings.seed, use_cpu=settings.device == "cpu",
        bf16=settings.precision == "bf16-mixed", fp16=False,
        gradient_checkpointing=settings.trl_gradient_checkpointing,
        # one optimizer step per batch of `prompts` pairs, over every pair of the dataset once
        per_device_train_batch_size=settings.prompts, gradient_accumulation_steps=1, max_steps=settings.steps,
        dataloader_num_workers=0,
        # the data: nothing truncated, no padding-free packing, no padding to a multiple
        max_length=settings.max_length, truncation_mode="keep_start", padding_free=False, pad_to_multiple_of=None,
        # the reference: adapters disabled, per step or once before training in batches of `prompts` pairs
        precompute_ref_log_probs=settings.precompute, precompute_ref_batch_size=settings.prompts,
        # the objective: DPO's sigmoid loss, summed log-probs, nothing else
        loss_type=["sigmoid"], beta=settings.beta, label_smoothing=0.0, ld_alpha=None,
        f_divergence_type="reverse_kl", use_weighting=False, sync_ref_model=False, disable_dropout=True,
        # the optimizer
        learning_rate=settings.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
    )


def run(settings: DPOSettings, lora: bool = True, profile: bool = False) -> None:
    """TRL's ``DPOTrainer`` on the benchmark's pairs (``lora``: a LoRA policy, else the whole model trained;
    ``profile``: the last step profiled); reports its measured steps and, precomputing, the pass's seconds."""
    import trl.trainer.dpo_trainer as dpo_module
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOTrainer

    tokenizer, policy = load_trl_side(settings, TRL_VERSION, "dpo_vs_trl.py")
    # In memory (not load_dataset of the file): a dataset with cache files would let TRL reuse the precomputed
    # log-probs of an earlier process from the datasets cache instead of computing them.
    dataset = Dataset.from_list(read_preference_pairs(settings))
    watch = Stopwatch(settings.device)
    precompute = {"seconds": 0.0, "hash": 0.0, "batches": 0}

    def timed(function, part: str | None = None):
        def wrapper(*args, **kwargs):
            start = watch.now()
            result = function(*args, **kwargs)
            precompute["seconds"] += watch.now() - start
            if part:
                precompute[part] += watch.now() - start
            return result

        return wrapper

    class TimedDPOTrainer(DPOTrainer):
        """TRL's trainer, its precomputation timed (it runs inside ``__init__``) and its batches counted."""

        def _precompute_ref_logps(self, *args, **kwargs):
            return timed(super()._precompute_ref_logps)(*args, **kwargs)

        def compute_ref_log_probs(self, *args, **kwargs):
            precompute["batches"] += 1
            return super().compute_ref_log_probs(*args, **kwargs)

    original_hash = dpo_module.hash_module
    dpo_module.hash_module = timed(original_hash, "hash")  # TRL hashes the reference weights only when precomputing
    try:
        trainer = TimedDPOTrainer(
            model=policy, args=dpo_config(settings), train_dataset=dataset, processing_class=tokenizer,
            peft_config=lora_spec(settings).to_peft(fan_in_fan_out=True) if lora else None,
        )
    finally:
        dpo_module.hash_module = original_hash
    check_data(trainer.train_dataset, settings)
    if settings.precompute:
        expected = -(-len(dataset) // settings.prompts)
        if precompute["batches"] != expected:  # e.g. read back from a datasets cache instead of computed
            raise RuntimeError(f"TRL computed {precompute['batches']} batches of reference log-probs, expected "
                               f"{expected}")
    rows: list[dict[str, Any]] = []
    marks: dict[str, float] = {}

    profiler = IterationProfiler(settings.steps - 1 if profile else None)

    class IterationTimer(TrainerCallback):
        """A step is timed from the end of the one before (``profile``: the last one is profiled)."""

        def on_train_begin(self, args, state, control, **kwargs):
            marks["last"] = watch.now()
            profiler.begin(0)

        def on_step_end(self, args, state, control, **kwargs):
            now = watch.now()
            rows.append({"seconds": now - marks["last"]})
            profiler.stop()
            profiler.begin(len(rows))
            marks["last"] = watch.now()

    trainer.add_callback(IterationTimer())
    trainer.train()
    if len(rows) != settings.steps:
        raise RuntimeError(f"TRL ran {len(rows)} optimizer steps, expected {settings.steps}")
    side = ("trl_lora" if lora else "trl") + ("_precomputed" if settings.precompute else "")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry and "train_loss" not in entry]
    result: dict[str, Any] = {"side": side, "iterations": rows[settings.warmup:], "first_loss": float(losses[0])}
    if settings.precompute:
        result["precompute"] = precompute["seconds"]
        result["precompute_hash"] = precompute["hash"]  # of which: hashing the reference weights
    report(result)


def check_data(dataset, settings: DPOSettings) -> None:
    """TRL's tokenized pairs are the benchmark's: every prompt, chosen and rejected response of the set lengths
    (EOS appended by TRL included), every pair kept."""
    lengths = {(len(row["prompt_ids"]), len(row["chosen_ids"]), len(row["rejected_ids"])) for row in dataset}
    expected = {(settings.prompt_length, settings.response_length, settings.rejected_length)}
    if lengths != expected or len(dataset) != settings.prompts * settings.steps:
        raise RuntimeError(f"TRL's pairs are not the benchmark's: (prompt, chosen, rejected) lengths {lengths}, "
                           f"expected {expected}; {len(dataset)} pairs")
