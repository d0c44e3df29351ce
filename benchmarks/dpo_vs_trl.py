"""DPO side by side: rlhf_lightning's DPO against TRL 1.16's DPOTrainer with LoRA, with the reference pass made at
every step and with the reference log-probs precomputed once before training, on the same random GPT-2-shaped
model, preference pairs and settings.

TRL 1.16 needs a virtualenv of its own (made as ``grpo_vs_trl.py`` says: ``pip install -e '.[bench-grpo]'``, i.e.
this package and ``trl==1.16.*``); every side runs with that environment's python, so both sides use the same
torch, transformers and peft. From the repository::

    venv-trl116/bin/python benchmarks/dpo_vs_trl.py --preset small
    venv-trl116/bin/python benchmarks/dpo_vs_trl.py --preset gpt2 --iterations 4 --repeats 2
    venv-trl116/bin/python benchmarks/dpo_vs_trl.py --preset gpt2 --sides ours,ours_precomputed,floor
    venv-trl116/bin/python benchmarks/dpo_vs_trl.py --preset gpt2 --sides ours --profile   # where ours goes
    venv-trl116/bin/python benchmarks/dpo_vs_trl.py --preset gpt2 --sides trl_lora --profile trl_lora   # TRL
    python benchmarks/dpo_vs_trl.py --dry-run --sides ours,ours_precomputed,floor   # does it run? (no TRL needed)

Every side runs in its own fresh process, alternating (ours, TRL+LoRA, ours precomputed, TRL+LoRA precomputed)
x ``--repeats``, each after ``--warmup`` steps. An iteration is one optimizer step on a batch of ``--pairs``
preference pairs (``2 x pairs`` rows: chosen and rejected). Every pair is a ``--prompt-length``-token prompt, a
``--chosen-length``-token chosen response and a ``--rejected-length``-token rejected one (EOS included), random
token ids written once to ``workdir/pairs.jsonl`` as text that the word-level tokenizer maps back to exactly those
ids; both sides read that file (ours through ``PreferenceDataModule``, TRL as a ``datasets.Dataset``) and check
the lengths they tokenized. The dataset holds exactly ``pairs x (warmup + iterations)`` pairs: one epoch. Every
side's first step must have the loss ln 2 (a new adapter adds zero, so the policy is still its reference, and
-log sigmoid(0) = ln 2): it is checked, and a side whose reference or loss is not DPO's stops the run.

What is timed, alike on both sides:

- ``seconds``: the median wall-clock seconds of a measured optimizer step, from the end of the previous step (data
  loading, collation, forward passes, loss, backward, gradient clipping, AdamW, the trainer's own bookkeeping and
  metrics); the warm-up steps are dropped.
- ``precompute`` (``_precomputed`` sides only): the seconds of the reference pass over every pair of the dataset,
  once per process before training, in batches of ``--pairs`` pairs, timed on its own and in no step. Ours:
  ``DPO.on_fit_start`` (the fingerprint of the pairs and ``compute_reference``); TRL: the hash of the reference
  weights that it keys its cache with (``hash_module``, made only when precomputing) and ``_precompute_ref_logps``
  (the pass and writing the values into the dataset); the round lines show TRL's hashing on its own.
- ``amortised``: ``seconds + precompute / (warmup + iterations)``, the step with its share of the pass, since the
  pass covers every step's pairs (one epoch); a longer run spreads it thinner, no run makes it cheaper than one
  reference forward per pair.
- peak resident memory of the whole process (the precompute pass included), with one copy of the fp32 weights
  beside it.

The last line printed is one JSON object: ``time_ratio_lora``, ``memory_ratio_lora`` (ours / TRL+LoRA, reference
pass per step); ``time_ratio_lora_precomputed`` (steps only, the pass excluded),
``time_ratio_lora_precomputed_amortised`` (the pass amortised as above), ``precompute_time_ratio_lora`` (the passes
alone) and ``memory_ratio_lora_precomputed``; ``time_ratio``/``memory_ratio`` (and ``_precomputed``) against TRL
training the whole model where the ``trl`` sides were asked for (``--sides``); ``floor_time_ratio`` and
``floor_memory_ratio`` (ours / the floor: the reference pass and one forward + backward + AdamW step of the policy,
each alone in a fresh process, done the fastest way we know; ``_precomputed``: ours precomputed / the policy piece
alone; see ``bench_floor``) where ``floor`` was asked for; the seconds, memory and settings.

What both sides are set to compute alike (ours: ``rlhf_lightning.DPO`` and ``lightning.Trainer`` arguments; TRL:
``DPOConfig`` fields, as TRL 1.16.0's ``trl/trainer/dpo_config.py`` names them):

| what | ours | TRL 1.16 |
|---|---|---|
| policy | LoRA r, alpha = 2r, all linear layers (not the LM head), no dropout | the same ``peft_config`` (``LoraSpec.to_peft``) |
| reference | the base, adapters disabled | adapters disabled (TRL's own choice for a new adapter, ``ref_model=None``) |
| reference mode | ``precompute_reference: false`` / ``true`` | ``precompute_ref_log_probs=False`` / ``True`` |
| precompute batch | ``val_batch_size`` = pairs | ``precompute_ref_batch_size`` = pairs |
| loss | ``preference_loss: Sigmoid`` (``label_smoothing`` 0), ``beta`` (``--beta``, 0.1 as TRL's default), ``rpo_alpha`` 0 | ``loss_type=["sigmoid"]``, ``beta`` 0.1, ``label_smoothing`` 0, ``f_divergence_type="reverse_kl"``, ``ld_alpha=None``, ``use_weighting=False`` |
| log-probs | summed over the response tokens (EOS included), temperature 1 | summed over the completion tokens (EOS included) |
| batch | ``batch_size`` = pairs, chosen and rejected in one forward of 2 x pairs rows | ``per_device_train_batch_size`` = pairs, ``gradient_accumulation_steps`` 1, the same 2 x pairs rows |
| lengths | ``max_length`` = prompt + longer response, ``on_too_long: error`` (nothing cut) | ``max_length`` = the same, ``truncation_mode="keep_start"`` (nothing cut) |
| EOS | appended to each response by ``encode_completion`` | appended to each response by TRL (plain-text data) |
| padding | right, to the longest row of the batch | right, to the longest row (``padding_free=False``, ``pad_to_multiple_of=None``) |
| optimizer | AdamW, ``optimizer.lr`` (``Settings.lr``, 1e-5), ``optimizer.adam_eps`` 1e-8, ``optimizer.weight_decay`` 0, ``optimizer.schedule: constant``, ``optimizer.warmup`` 0 | ``optim="adamw_torch"``, ``learning_rate``, ``adam_epsilon`` 1e-8, ``weight_decay`` 0, ``lr_scheduler_type="constant"``, ``warmup_steps`` 0 |
| gradient clipping | the Trainer's ``gradient_clip_val=1.0``, ``gradient_clip_algorithm="norm"`` | ``max_grad_norm=1.0`` |
| dropout | off | ``disable_dropout=True`` |
| gradient checkpointing | none | ``gradient_checkpointing=False`` (DPOConfig's default is True: ``--trl-gradient-checkpointing`` measures it) |
| precision | Lightning's ``32`` / ``bf16-mixed`` | ``bf16`` False / True (DPOConfig's default is True) |
| steps | ``max_epochs=1``, ``limit_train_batches`` = warmup + iterations | ``max_steps`` = warmup + iterations |
| data loading | in the main process, shuffled | ``dataloader_num_workers=0``, shuffled |
| reference model copy | none (one base) | none with LoRA; a second model for the ``trl`` sides without precomputing |

Not aligned (each side as it is built): TRL's fused LM head (``add_fused_lm_head``), in tiles, scores every
position of the row on CPU (only the completion positions on Triton devices, e.g. CUDA) and computes with the
log-probs the entropy, mean logit and top-1 flag (its ``entropy``, ``logits/*``, ``mean_token_accuracy`` metrics);
ours runs the LM head from the first response column on, log-probs only; the logged metrics differ (TRL
syncs a dozen scalars to Python every step, ours logs its ``dpo/*`` values through Lightning); our base uses the
fused tanh-GELU kernel (``fuse_tanh_gelu``), TRL the model as loaded; ours checks the loss and gradients for
non-finite values each step; precomputing, TRL hashes the reference weights and writes the values into an Arrow
file, ours fingerprints the pairs' token ids and keeps a tensor; TRL's ``padding_free`` is unavailable in 1.16
(it falls back to padding), so both pad; the shuffled orders differ (every pair has the same lengths, so every
batch has the same shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from harness.arguments import DRY_RUN as COMMON_DRY_RUN
from harness.arguments import (
    add_common_arguments,
    add_dry_run_argument,
    common_settings,
    parse_with_dry_run,
    side_order,
)
from harness.fixtures import prepare_workdir, write_preference_pairs
from harness.measure import GIB, peak_memory_key, weights_bytes
from harness.processes import run_rounds
from harness.settings import DPOSettings
from harness.tables import print_phases, summarise

SIDES = ("ours", "trl_lora", "trl", "ours_precomputed", "trl_lora_precomputed", "trl_precomputed")
DEFAULT_SIDES = "ours,trl_lora,ours_precomputed,trl_lora_precomputed"
DRY_RUN = {**COMMON_DRY_RUN, "pairs": 2, "prompt_length": 4, "chosen_length": 4, "rejected_length": 3}
PRECOMPUTED = "_precomputed"
# A new adapter adds zero, so at the first step the policy is the reference and every side's loss is -log sigmoid(0)
FIRST_LOSS = math.log(2)
TIMING = ("seconds: median wall-clock seconds per measured optimizer step (warm-up dropped), the reference pass "
          "in the step unless precomputed; precompute: seconds of the reference pass over every pair of the "
          "dataset, once per process before training, in no step; amortised: seconds + precompute / "
          "(warmup + iterations), the pass spread over the one epoch it covers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--dry-run``: the tiny sizes of ``DRY_RUN`` where not given)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, iterations=4, unit="optimizer steps", profile_sides=SIDES)
    parser.add_argument("--pairs", type=int, default=8, help="preference pairs per optimizer step")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--chosen-length", type=int, default=64, help="chosen response tokens, EOS included")
    parser.add_argument("--rejected-length", type=int, default=48, help="rejected response tokens, EOS included")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--sides", default=DEFAULT_SIDES,
                        help=f"comma-separated subset of {','.join(SIDES)},floor (trl, trl_precomputed: TRL "
                             "training the whole model)")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="leave TRL's default gradient checkpointing on (ours has none)")
    parser.add_argument("--dpo-options", default="{}",
                        help="JSON of extra rlhf_lightning.DPO arguments for our side, e.g. '{\"logprob_chunk\": 16}'")
    add_dry_run_argument(parser, DRY_RUN)
    return parse_with_dry_run(parser, argv, DRY_RUN)


def child_main(side: str, settings: DPOSettings, profile: bool) -> None:
    """Measure ``side`` in this process (a child of :func:`main`)."""
    if side.startswith("floor/"):
        import bench_floor

        bench_floor.run(settings, side)
        return
    base = side.removesuffix(PRECOMPUTED)
    if base == "ours":
        import bench_ours

        bench_ours.run_dpo(settings, profile)
    elif base in ("trl", "trl_lora"):
        import bench_trl_dpo

        bench_trl_dpo.run(settings, lora=base == "trl_lora", profile=profile)
    else:
        raise ValueError(f"unknown side {side!r}")


def checked_precompute(side: str, result: dict[str, Any]) -> str:
    """A process's precompute seconds for its round line, after checking that its first step's loss is DPO's
    at a policy equal to its reference."""
    if "first_loss" in result and abs(result["first_loss"] - FIRST_LOSS) > 0.01:
        raise RuntimeError(f"{side}: first step's loss {result['first_loss']:.4f}, not ln 2 = {FIRST_LOSS:.4f}: "
                           "its reference is not the base its new adapter starts from, or its loss not DPO's")
    precompute = f" precompute {result['precompute']:.2f} s" if "precompute" in result else ""
    if "precompute_hash" in result:
        precompute += f" (hashing the weights {result['precompute_hash']:.2f} s)"
    return precompute


def amortised(entry: dict[str, Any], settings: DPOSettings) -> float:
    """Seconds of a step with its share of the precomputed reference pass."""
    return entry["seconds"] + entry.get("precompute", 0.0) / settings.steps


def print_table(summary: dict[str, dict[str, Any]], floors: dict[str, dict[str, Any]], settings: DPOSettings,
                weights: int, memory_key: str) -> None:
    """The DPO table: per side seconds per step, precompute, amortised, pairs per second and peak memory."""
    print(f"\none copy of the weights: {weights / GIB:.3f} GiB; peak memory = {memory_key}; {TIMING}")
    print(f"{'side':<22} {'s/step':>8} {'precompute':>10} {'amortised':>9} {'pairs/s':>8} {'peak GiB':>9} "
          f"{'x weights':>9}")
    for side in SIDES:
        if side in summary:
            s = summary[side]
            precompute = f"{s['precompute']:>10.2f}" if "precompute" in s else f"{'-':>10}"
            print(f"{side:<22} {s['seconds']:>8.3f} {precompute} {amortised(s, settings):>9.3f} "
                  f"{settings.prompts / s['seconds']:>8.1f} {s[memory_key] / GIB:>9.3f} {s[memory_key] / weights:>9.1f}")
    for name, floor in floors.items():
        if floor:
            pieces = " + ".join(f"{piece} {seconds:.3f}" for piece, seconds in floor["pieces"].items())
            print(f"{name:<22} {floor['seconds']:>8.3f} {'-':>10} {floor['seconds']:>9.3f} "
                  f"{settings.prompts / floor['seconds']:>8.1f} {floor['peak'] / GIB:>9.3f} "
                  f"{floor['peak'] / weights:>9.1f}   ({pieces})")


def final_json(summary: dict[str, dict[str, Any]], floors: dict[str, dict[str, Any]], settings: DPOSettings,
               weights: int, memory_key: str) -> dict[str, Any]:
    """The last line printed: the ratios (ours / TRL, ours / the floor, per step, precomputed and amortised),
    seconds, memory and the settings."""
    def ratio(ours: str, theirs: str, value) -> float | None:
        if ours not in summary or theirs not in summary:
            return None
        return round(value(summary[ours]) / value(summary[theirs]), 3)

    def floor_ratio(ours: str, floor: dict[str, Any], key: str, floor_key: str) -> float | None:
        if ours not in summary or not floor:
            return None
        return round(summary[ours][key] / floor[floor_key], 3)

    def seconds(entry):
        return entry["seconds"]

    def memory(entry):
        return entry[memory_key]

    result: dict[str, Any] = {}
    for other, label in (("trl_lora", "_lora"), ("trl", "")):
        result[f"time_ratio{label}"] = ratio("ours", other, seconds)
        result[f"memory_ratio{label}"] = ratio("ours", other, memory)
        mine, theirs = "ours" + PRECOMPUTED, other + PRECOMPUTED
        result[f"time_ratio{label}{PRECOMPUTED}"] = ratio(mine, theirs, seconds)
        result[f"time_ratio{label}{PRECOMPUTED}_amortised"] = ratio(mine, theirs, lambda e: amortised(e, settings))
        result[f"precompute_time_ratio{label}"] = ratio(mine, theirs, lambda e: e["precompute"])
        result[f"memory_ratio{label}{PRECOMPUTED}"] = ratio(mine, theirs, memory)
    for suffix in ("", PRECOMPUTED):
        result[f"floor_time_ratio{suffix}"] = floor_ratio("ours" + suffix, floors["floor" + suffix], "seconds",
                                                          "seconds")
        result[f"floor_memory_ratio{suffix}"] = floor_ratio("ours" + suffix, floors["floor" + suffix], memory_key,
                                                            "peak")
    result.update({
        "seconds": {side: round(s["seconds"], 4) for side, s in summary.items()}
        | {name: round(f["seconds"], 4) for name, f in floors.items() if f},
        "precompute_seconds": {side: round(s["precompute"], 4) for side, s in summary.items() if "precompute" in s},
        "amortised_seconds": {side: round(amortised(s, settings), 4) for side, s in summary.items()
                              if "precompute" in s},
        "peak_gib": {side: round(s[memory_key] / GIB, 3) for side, s in summary.items()}
        | {name: round(f["peak"] / GIB, 3) for name, f in floors.items() if f},
        "weights_gib": round(weights / GIB, 3),
        "timing": TIMING,
        "settings": dpo_settings(settings),
    })
    return result


def dpo_settings(settings: DPOSettings) -> dict[str, Any]:
    """The settings in the JSON, in this benchmark's words (``prompts`` are the pairs per step, ``response_length``
    the chosen response's; no PPO passes)."""
    values = json.loads(settings.to_json())
    names = {"prompts": "pairs", "response_length": "chosen_length", "ppo_options": "dpo_options"}
    dropped = {"workdir", "precompute", "ppo_epochs", "num_minibatches"}
    result = {names.get(k, k): v for k, v in values.items() if k not in dropped}
    result["max_length"] = settings.max_length
    return result


def main(argv: list[str] | None = None) -> None:
    """Prepare the model folder and pairs, run the rounds, print the table and the JSON line (or, as a child, one
    side)."""
    args = parse_args(argv)
    if args.child:
        child_main(args.child, DPOSettings.from_json(args.settings), bool(args.profile))
        return
    if min(args.prompt_length, args.chosen_length - 1, args.rejected_length - 1, args.pairs) < 1:
        raise SystemExit("--pairs and --prompt-length must be >= 1, --chosen-length and --rejected-length >= 2 "
                         "(a response token and EOS)")
    settings = DPOSettings(
        **common_settings(args, "dpo"), prompts=args.pairs, prompt_length=args.prompt_length,
        response_length=args.chosen_length, rejected_length=args.rejected_length, beta=args.beta,
        ppo_options=json.loads(args.dpo_options), trl_gradient_checkpointing=args.trl_gradient_checkpointing,
    )
    import bench_floor  # here, not at the top: the children import only what their side needs

    order = side_order(args.sides, SIDES, bench_floor.DPO_PIECES)
    print(f"workdir {settings.workdir}; settings {settings.to_json()}", flush=True)
    prepare_workdir(settings, reward_adapter=False)
    write_preference_pairs(settings)
    weights = weights_bytes(settings)
    results = run_rounds(
        __file__, order, settings, args.profile, unit="s/step", digits=3, details=checked_precompute,
        settings_of=lambda side: dataclasses.replace(settings, precompute=side.endswith(PRECOMPUTED)))
    summary = summarise(results)
    memory_key = peak_memory_key(args.device)
    summary, floors = bench_floor.split(
        summary, {"floor": bench_floor.DPO_PIECES, "floor" + PRECOMPUTED: ["policy_update"]}, memory_key)
    print_table(summary, floors, settings, weights, memory_key)
    for side in ("ours", "ours" + PRECOMPUTED):
        if side in summary:
            print_phases(f"where our step goes ({side}, median seconds per piece)", summary[side],
                         "other (data, loss, metrics, loop)", digits=3)
    print(json.dumps(final_json(summary, floors, settings, weights, memory_key)))


if __name__ == "__main__":
    main()
