"""The methods of the family study: which config each starts from, which setting holds its KL, and at which
values it runs.

Every run is the shipped config of its method (``configs/<config>``) with the seed of the pipeline, the seed's
SFT model and reward model, the strength under study, and the study's bookkeeping (no checkpoints, no own
validation: :class:`~rlhf_lightning.study.evaluation.HeldOutEvaluation` measures every method the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Method:
    """A method of the study.

    ``strengths`` run from the weakest hold on the policy (largest KL) to the strongest, with the shipped
    config's value (or the README's, for the DPO variants) in the middle. ``steps`` are the training batches of the shipped config (iterations of an online
    method, optimizer steps of DPO).
    """

    name: str
    label: str
    config: str
    strength: str
    strengths: tuple[float, ...]
    steps: int
    every: int
    overrides: tuple[str, ...] = ()
    uses_reward_model: bool = True
    teacher: str | None = None  # distillation: the method whose run at its shipped strength, same seed, teaches
    # Whether a training batch is one optimizer step (the DPO family, KTO): the run is then bounded by max_steps,
    # so that a decaying learning-rate schedule spans the run's `steps` as in its shipped config.
    offline: bool = False

    @property
    def shipped(self) -> float:
        """The strength of the shipped config (the README's for the DPO variants)."""
        return self.strengths[1]

    def quick_strengths(self) -> tuple[float, ...]:
        """The two strengths of ``--quick``: the weakest hold and the shipped one (a short run moves little)."""
        return self.strengths[:2]


METHODS: dict[str, Method] = {method.name: method for method in (
    Method("ppo", "PPO", "ppo.yaml", "kl.coef", (0.02, 0.07, 0.2), steps=96, every=16,
           overrides=("--model.init_args.kl.target=null",)),
    Method("grpo", "GRPO", "grpo.yaml", "kl.coef", (0.03, 0.1, 0.3), steps=128, every=16),
    Method("dr_grpo", "Dr. GRPO", "grpo.yaml", "kl.coef", (0.03, 0.1, 0.3), steps=128, every=16,
           overrides=("--model.init_args.advantages.scale_rewards=none",
                      "--model.init_args.loss.aggregation=constant")),
    Method("cispo", "GRPO with CISPO", "grpo.yaml", "kl.coef", (0.03, 0.1, 0.3), steps=128, every=16,
           overrides=("--model.init_args.policy_loss=CISPO",)),
    # The sampler's log-probs against the trainer's, truncated at 3 (TIS): on CPU in fp32 they agree to ~1e-13 nats of
    # KL per token (largest difference ~1e-5), so this row shows what the correction costs and changes without a
    # mismatch to correct.
    Method("tis", "GRPO with truncated IS", "grpo.yaml", "kl.coef", (0.03, 0.1, 0.3), steps=128, every=16,
           overrides=("--model.init_args.correction.mode=token_truncate",)),
    Method("rloo", "RLOO", "rloo.yaml", "kl.coef", (0.02, 0.05, 0.15), steps=128, every=16),
    Method("reinforce_pp", "REINFORCE++-baseline", "reinforce_pp.yaml", "kl.coef", (0.02, 0.05, 0.15),
           steps=128, every=16),
    Method("online_dpo", "online DPO", "online_dpo.yaml", "beta", (0.1, 0.3, 1.0), steps=128, every=16),
    # The teacher is the seed's GRPO policy at its shipped strength (an adapter on the same base). What holds the
    # student near the SFT policy is its learning rate (no KL term), so that is the strength here.
    Method("distill", "on-policy distillation (GRPO teacher)", "distill.yaml", "optimizer.lr", (3.0e-3, 1.0e-3, 3.0e-4),
           steps=128, every=16, teacher="grpo"),
    Method("dpo", "DPO", "dpo.yaml", "beta", (0.03, 0.1, 0.3), steps=300, every=50, uses_reward_model=False,
           offline=True),
    Method("dpo_norm", "length-normalised DPO", "dpo.yaml", "beta", (1.0, 3.0, 10.0), steps=300, every=50,
           overrides=("--model.init_args.preference_loss=SigmoidNorm",), uses_reward_model=False, offline=True),
    Method("kto", "KTO", "kto.yaml", "beta", (0.1, 0.3, 1.0), steps=300, every=50, uses_reward_model=False,
           offline=True),
    # SimPO has no reference: its beta scales the margin, not a KL term. What holds it near the SFT policy is
    # the learning rate (README: 1e-3 collapses, 1e-4 is stable), so that is its strength here.
    Method("simpo", "SimPO", "dpo.yaml", "optimizer.lr", (3.0e-4, 1.0e-4, 3.0e-5), steps=300, every=50,
           overrides=("--model.init_args.preference_loss={class_path: SimPO, init_args: {gamma: 0.5}}",
                      "--model.init_args.beta=2.0"), uses_reward_model=False, offline=True),
)}

BEST_OF_N = "best_of_n"
"""Best-of-n of the SFT policy against the proxy: no training, a curve over n (``--best-of-n``)."""


def run_arguments(method: Method, strength: float, seed: int, configs: str | Path, sft_model: str | Path,
                  reward_adapter: str | Path, directory: Path, group: str, steps: int,
                  overrides: Sequence[str] = ()) -> list[str]:
    """The ``fit`` command line of one study run (``overrides`` come last and win).

    The run writes only under ``directory``: its W&B run (in ``group``), the exported adapters and the resolved
    config.
    """
    arguments = [
        "fit", "--config", str(Path(configs) / method.config),
        f"--seed_everything={seed}", f"--data.init_args.seed={seed}",
        f"--model.init_args.base.name_or_path={sft_model}",
        f"--model.init_args.{method.strength}={strength}",
        f"--model.init_args.export_dir={(directory / 'adapters').absolute()}",
        f"--trainer.default_root_dir={directory}",
        f"--trainer.logger.init_args.save_dir={directory}",
        f"--trainer.logger.init_args.group={group}",
        f"--trainer.logger.init_args.name={method.name}-{method.strength}={strength:g}-seed{seed}",
        "--trainer.callbacks=[]",
        "--trainer.enable_checkpointing=false",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        # Online: an upper bound, HeldOutEvaluation stops the fit after `steps` batches (iterations of several
        # optimizer steps each). Offline: the steps themselves, which the learning-rate schedule spans.
        *(["--trainer.max_steps=" + str(steps), "--trainer.max_epochs=-1"] if method.offline
          else ["--trainer.max_steps=-1", f"--trainer.max_epochs={steps}"]),
        "--trainer.enable_progress_bar=false",
    ]
    if method.uses_reward_model:
        arguments.append(f"--model.init_args.reward.init_args.path={reward_adapter}")
    return [*arguments, *method.overrides, *overrides]
