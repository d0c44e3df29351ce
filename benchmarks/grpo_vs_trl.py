"""GRPO side by side: rlhf_lightning's GRPO against TRL 1.16's GRPOTrainer with LoRA, at beta > 0 and at beta = 0,
and against the floor (the bare pieces no framework can avoid), on the same random GPT-2-shaped model, prompts
and settings.

TRL 1.16 needs a virtualenv of its own (TRL 1.12 stays in the main one for ``ppo_vs_trl.py``); every side runs
with that environment's python, so both sides use the same torch, transformers and peft. From the repository::

    python3 -m venv venv-trl116
    venv-trl116/bin/pip install torch==2.13.0       # first: the CPU build (or the CUDA build you want)
    venv-trl116/bin/pip install -e '.[bench-grpo]'  # this package + trl==1.16.* (transformers>=4.56.2, peft)
    venv-trl116/bin/python benchmarks/grpo_vs_trl.py --preset small
    venv-trl116/bin/python benchmarks/grpo_vs_trl.py --preset gpt2 --iterations 2 --repeats 2
    venv-trl116/bin/python benchmarks/grpo_vs_trl.py --preset gpt2 --sides ours --profile   # where ours goes
    venv-trl116/bin/python benchmarks/grpo_vs_trl.py --preset gpt2 --sides trl_lora --profile trl_lora   # TRL
    python benchmarks/grpo_vs_trl.py --dry-run --sides ours,floor   # does it run? (no TRL needed for these sides)

(Measured with trl 1.16.0, transformers 5.23.0, peft 0.21.2, torch 2.13.0: the versions of the main environment.)

Every side runs in its own fresh process, alternating (ours, TRL+LoRA, ours at beta 0, TRL+LoRA at beta 0, the
floor's pieces) x ``--repeats``, each after ``--warmup`` iterations. An iteration is one rollout of ``--prompts``
x ``--group-size`` responses and its ``--epochs`` x ``--minibatches`` optimizer steps. Reported per side: median
seconds per iteration, its rollout/update split, generated tokens per second and peak resident memory (with one
copy of the weights beside it). The last line printed is one JSON object: ``time_ratio_lora`` and
``memory_ratio_lora`` (ours / TRL+LoRA at beta > 0), the same with ``_beta0``, ``floor_time_ratio`` and
``floor_memory_ratio`` (ours / the floor with its reference pass, at beta > 0; ``_beta0``: without it), the
``time_ratio``/``memory_ratio`` against TRL training the whole model where the ``trl`` sides were asked for
(``--sides``), and the settings.

The reward on both sides is the same cheap Python function with TRL's reward-function signature
(``harness.fixtures.even_token_reward``: the fraction of even token ids in the completion), so no reward model's
forward pass muddies the comparison; it varies within a group, so advantages and gradients are not zero.

What both sides are set to compute alike (ours: ``rlhf_lightning.GRPO`` arguments; TRL: ``GRPOConfig`` fields):

| what | ours | TRL 1.16 |
|---|---|---|
| policy | LoRA r, alpha = 2r, all linear layers, no dropout | the same ``peft_config`` (``LoraSpec.to_peft``) |
| reference | adapters disabled, only at beta > 0 | adapters disabled (TRL's own choice for a new adapter), only at beta > 0 |
| group size | ``samples_per_prompt`` | ``num_generations`` |
| rollout | ``prompts`` prompts per batch | ``generation_batch_size`` = ``per_device_train_batch_size`` x ``steps_per_generation`` = prompts x group |
| update passes | ``epochs``, ``num_minibatches`` (one micro-batch each) | ``num_iterations``, ``steps_per_generation`` (``per_device_train_batch_size`` = rows / minibatches, ``gradient_accumulation_steps`` 1) |
| old log-probs | a pass when more than one optimizer step | the same condition (``gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0``) |
| response length | ``sampling.max_new_tokens``, ``sampling.stop_token: null`` | ``max_completion_length``, ``generation_kwargs={"min_new_tokens": R}`` (EOS suppressed, so always R tokens; TRL always stops at EOS otherwise) |
| sampling | temperature 1, top_k 0, top_p 1 | the same |
| advantages | ``advantages: GroupRelative`` (``scale_rewards: group``, ``std_eps`` 1e-4, Bessel std) | ``scale_rewards="group"`` (its fixed 1e-4) |
| KL | ``kl.coef`` = beta, ``kl.estimator: k3``, ``kl.added_to: loss``, ``kl.ratio_weighting: true`` | ``beta``, k3 in the loss, ``use_bias_correction_kl=True`` |
| loss | clipped surrogate, ``policy_loss: {clip_range: 0.2}``, token ratios, ``loss.aggregation: token_mean`` over the optimizer step | ``epsilon`` 0.2, ``importance_sampling_level="token"``, ``loss_type="dapo"`` (tokens of the step) |
| no extras | ``loss.ent_coef`` 0, ``loss.mask_truncated_completions`` false | ``entropy_coef`` 0, ``top_entropy_quantile`` 1, ``mask_truncated_completions=False`` |
| optimizer | AdamW, lr, eps 1e-8, no weight decay, constant schedule, grad norm clipped to 1 | ``optim="adamw_torch"``, ``learning_rate``, ``adam_epsilon`` 1e-8, ``weight_decay`` 0, ``lr_scheduler_type="constant"``, ``max_grad_norm`` 1 |
| dropout | off | ``disable_dropout=True`` (TRL's default leaves GPT-2's 0.1 on) |
| gradient checkpointing | none | ``gradient_checkpointing=False`` (GRPOConfig's default is True: ``--trl-gradient-checkpointing`` measures it) |
| precision | Lightning's ``32`` / ``bf16-mixed`` | ``bf16`` False / True (GRPOConfig's default is True) |
| prompts | the same ids | the same ids, as text that the word-level tokenizer maps back to them |

``--lengths task`` or ``long-tail`` (``harness/lengths.py``) replaces the response-length row: the stop token on
(ours ``sampling.stop_token: eos``; TRL its own stop at EOS, no ``min_new_tokens``) and each row's EOS forced where a seeded
plan puts it, by the same logits processor on every side, so every side samples the same lengths row by row; the
realised mean and max per side are printed and in the JSON (``response_lengths``, ``same_lengths``).
``--workload chat256``/``chat512``: prompt 256/512, response 128, group 8.

Not aligned (each side as it is built): TRL computes the entropy in every loss forward and logs per-step metrics;
TRL shuffles the generation batch once and reuses its minibatches over ``num_iterations``, ours reshuffles every
epoch; the sampled tokens differ (different random streams; TRL's EOS suppression), not their number; our
generation uses its static KV cache and sampler, TRL ``model.generate`` with its defaults.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from harness.arguments import DRY_RUN as COMMON_DRY_RUN
from harness.arguments import (
    add_common_arguments,
    add_dry_run_argument,
    add_workload_arguments,
    common_settings,
    parse_with_dry_run,
    side_order,
)
from harness.fixtures import prepare_workdir
from harness.flops import grpo_iteration_flops, matmul_flops_per_second
from harness.lengths import lengths_summary, print_flops_caveat, print_lengths, same_lengths
from harness.measure import GIB, peak_memory_key, weights_bytes
from harness.processes import run_rounds
from harness.settings import GRPOSettings
from harness.sides import configure_threads
from harness.tables import print_iteration_table, print_phases, summarise

SIDES = ("ours", "trl_lora", "trl", "ours_beta0", "trl_lora_beta0", "trl_beta0")
DEFAULT_SIDES = "ours,trl_lora,ours_beta0,trl_lora_beta0,floor"
DRY_RUN = {**COMMON_DRY_RUN, "prompts": 2, "group_size": 2, "prompt_length": 4, "response_length": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--dry-run``: the tiny sizes of ``DRY_RUN`` where not given)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, iterations=2, unit="iterations", profile_sides=SIDES)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=8,
                        help="responses per prompt (TRL's num_generations; its default 8)")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1, help="passes over each rollout (TRL's num_iterations)")
    parser.add_argument("--minibatches", type=int, default=1,
                        help="optimizer steps per pass (TRL's steps_per_generation)")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient of the beta > 0 sides")
    parser.add_argument("--sides", default=DEFAULT_SIDES,
                        help=f"comma-separated subset of {','.join(SIDES)},floor (trl, trl_beta0: TRL training "
                             "the whole model, reference a second copy)")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="leave TRL's default gradient checkpointing on (ours has none)")
    parser.add_argument("--grpo-options", default="{}",
                        help="JSON of extra rlhf_lightning.GRPO arguments for our side, e.g. '{\"logprob_chunk\": 16}'")
    add_workload_arguments(parser)
    add_dry_run_argument(parser, DRY_RUN)
    return parse_with_dry_run(parser, argv, DRY_RUN)


def child_main(side: str, settings: GRPOSettings, profile: bool) -> None:
    """Measure ``side`` in this process (a child of :func:`main`)."""
    if side.startswith("floor/"):
        import bench_floor

        bench_floor.run(settings, side)
        return
    base = side.removesuffix("_beta0")
    beta = 0.0 if side.endswith("_beta0") else settings.beta
    if base == "ours":
        import bench_ours

        bench_ours.run_grpo(settings, beta, profile)
    elif base in ("trl", "trl_lora"):
        import bench_trl_grpo

        bench_trl_grpo.run(settings, beta, lora=base == "trl_lora", profile=profile)
    else:
        raise ValueError(f"unknown side {side!r}")


def print_flops(ours: dict[str, Any], flops: dict[str, float], matmul: float) -> None:
    """Our iteration's analytic FLOPs, the machine's matmul throughput and the fraction of it we reach."""
    achieved = flops["total"] / ours["seconds"]
    print(f"analytic FLOPs per iteration: {flops['total'] / 1e12:.3f} TFLOP; measured matmul throughput "
          f"{matmul / 1e9:.1f} GFLOP/s; achieved {achieved / 1e9:.1f} GFLOP/s = {achieved / matmul:.1%}")


def final_json(summary, floors, settings: GRPOSettings, weights: int, flops: dict[str, dict[str, float]],
               matmul: float, memory_key: str) -> dict[str, Any]:
    """The last line printed: the ratios (ours / TRL, ours / the floor, at beta > 0 and 0), seconds, memory and the
    settings."""
    def ratio(ours: str, other: dict | None, key: str, other_key: str | None = None) -> float | None:
        if ours not in summary or not other:
            return None
        return round(summary[ours][key] / other[other_key or key], 3)

    result: dict[str, Any] = {}
    for suffix in ("", "_beta0"):
        ours = f"ours{suffix}"
        result[f"time_ratio_lora{suffix}"] = ratio(ours, summary.get(f"trl_lora{suffix}"), "seconds")
        result[f"memory_ratio_lora{suffix}"] = ratio(ours, summary.get(f"trl_lora{suffix}"), memory_key)
        result[f"time_ratio{suffix}"] = ratio(ours, summary.get(f"trl{suffix}"), "seconds")
        result[f"memory_ratio{suffix}"] = ratio(ours, summary.get(f"trl{suffix}"), memory_key)
        floor = floors[f"floor{suffix}"]
        result[f"floor_time_ratio{suffix}"] = ratio(ours, floor, "seconds")
        result[f"floor_memory_ratio{suffix}"] = ratio(ours, floor, memory_key, "peak")
    result.update({
        "seconds": {side: round(s["seconds"], 3) for side, s in summary.items()}
        | {name: round(f["seconds"], 3) for name, f in floors.items() if f},
        "peak_gib": {side: round(s[memory_key] / GIB, 3) for side, s in summary.items()}
        | {name: round(f["peak"] / GIB, 3) for name, f in floors.items() if f},
        "weights_gib": round(weights / GIB, 3),
        "ours_tokens_per_second": {side: round(summary[side]["tokens_per_second"], 1)
                                   for side in ("ours", "ours_beta0") if side in summary},
        "flops_per_iteration": {side: f["total"] for side, f in flops.items()},
        "matmul_flops_per_second": matmul,
        "achieved_fraction": {side: round(flops[side]["total"] / summary[side]["seconds"] / matmul, 3)
                              for side in ("ours", "ours_beta0") if side in summary},
        "settings": {k: v for k, v in json.loads(settings.to_json()).items() if k != "workdir"},
    })
    return result


def main(argv: list[str] | None = None) -> None:
    """Prepare the model folder, run the rounds, print the tables and the JSON line (or, as a child, one side)."""
    args = parse_args(argv)
    if args.child:
        child_main(args.child, GRPOSettings.from_json(args.settings), bool(args.profile))
        return
    if (args.prompts * args.group_size) % args.minibatches:
        raise SystemExit(f"--prompts x --group-size = {args.prompts * args.group_size} responses do not split "
                         f"into --minibatches {args.minibatches}")
    settings = GRPOSettings(
        **common_settings(args, "grpo"), prompts=args.prompts, prompt_length=args.prompt_length,
        response_length=args.response_length, ppo_epochs=args.epochs, num_minibatches=args.minibatches,
        ppo_options=json.loads(args.grpo_options), group_size=args.group_size, beta=args.beta,
        trl_gradient_checkpointing=args.trl_gradient_checkpointing,
    )
    import bench_floor

    order = side_order(args.sides, SIDES, bench_floor.GRPO_PIECES)
    print(f"workdir {settings.workdir}; settings {settings.to_json()}", flush=True)
    prepare_workdir(settings, reward_adapter=False)
    weights = weights_bytes(settings)
    configure_threads(settings)  # the children's thread count, so the matmul peak is theirs
    matmul = matmul_flops_per_second(args.device, quick=args.dry_run)
    summary = summarise(run_rounds(__file__, order, settings, args.profile))
    print_lengths(summary, settings)
    lengths = {"response_lengths": lengths_summary(summary), "same_lengths": same_lengths(summary, settings)}
    memory_key = peak_memory_key(args.device)
    summary, floors = bench_floor.split(summary, {
        "floor": bench_floor.GRPO_PIECES,
        "floor_beta0": [piece for piece in bench_floor.GRPO_PIECES if piece != "reference"]}, memory_key)
    flops = {"ours": grpo_iteration_flops(settings, settings.beta), "ours_beta0": grpo_iteration_flops(settings, 0.0)}
    print_iteration_table(summary, SIDES, floors, weights, memory_key)
    for side in ("ours", "ours_beta0"):
        if side in summary:
            print_phases(f"where our iteration goes ({side}, median seconds per piece)", summary[side],
                         "other (rewards, advantages, losses, loop)")
            print_flops(summary[side], flops[side], matmul)
            print_flops_caveat(settings)
    print(json.dumps(final_json(summary, floors, settings, weights, flops, matmul, memory_key) | lengths))


if __name__ == "__main__":
    main()
