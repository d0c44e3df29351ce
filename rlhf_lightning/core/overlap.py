"""Asynchronous training with a fixed lag: the rollouts of the next ``max_staleness`` iterations are drawn while the
policy trains.

The schedule (``S`` = ``max_staleness``): iteration ``m`` trains on a rollout drawn by the policy that iteration
``d(m) = max(0, m - S)`` started from. When iteration ``n`` starts, the rollout of iteration ``n + S`` is submitted
to the :class:`~rlhf_lightning.rollout.producer.RolloutProducer`, drawn by the current adapter, on the prompts the
training loader will hand out then (:meth:`~rlhf_lightning.data.loader.ResumableLoader.ahead`); iteration ``n``
takes its own rollout, submitted ``S`` iterations earlier (the first ``S`` iterations of a run are drawn by the
starting policy, all at once). This is the admission bound of AReaL and SkyRL (at policy version ``v``, at most
``(S + v + 1) B`` prompts admitted) at the granularity of a batch; nothing is dropped.

A run is a function of its seed: every request's seed comes from the run's streams
(:meth:`~rlhf_lightning.rollout.seeds.Seeds.ahead`, the synchronous loop's own seeds for the iteration), the
prompts from the loader's seeded order, the weights from the schedule. A checkpoint holds the adapters of the
policies the untrained rollouts were drawn by (the last ``S + 1`` iterations' starting adapters, LoRA weights only);
a resumed run loads them into the server again and redraws those rollouts, the same requests as before, so it goes
on as the uninterrupted run would have.

After the rollout, everything is as in the synchronous loop: the trainer's log-probs (the proximal policy, the
policy at the start of the update), the reference's, the rewards and the algorithm's passes are made at the
iteration that trains, on its current weights; the sampler's log-probs are the behaviour policy's.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.core.policy import POLICY, PolicyModule
from rlhf_lightning.rollout.producer import Job, RolloutProducer
from rlhf_lightning.rollout.rollouts import Rollout, Rollouts
from rlhf_lightning.rollout.sampler import Sampler
from rlhf_lightning.rollout.vllm_server import ServedVersion
from rlhf_lightning.rollout.vllm_support import adapter_tensors
from rlhf_lightning.utils.atomic_io import CheckpointError
from rlhf_lightning.utils.timing import phase

STATE_KEY = "rollouts_ahead"


class Overlap:
    """The fixed-lag schedule of one module's training rollouts (see the module docstring).

    Args:
        module: the online module (an :class:`~rlhf_lightning.core.collect.ExperienceCollector`) whose rollouts
            are drawn ahead (its engine must overlap:
            :meth:`~rlhf_lightning.rollout.engines.Engine.overlap_refusal`).
        staleness: ``max_staleness``, at least 1.
        timeout: seconds the trainer waits for a rollout before the fit stops (``rollout_timeout``).
    """

    def __init__(self, module: PolicyModule, staleness: int, timeout: float) -> None:
        self.module, self.staleness, self.timeout = module, staleness, timeout
        self.server = module.sampler.engine(module.model)
        self.engine = ServedVersion(self.server)
        sampler = module.sampler
        hp = module.hparams
        # Its own sampler (the engine that names versions) and its own tokenizer: a fast tokenizer used by two
        # threads at once can fail ("Already borrowed").
        self.rollouts = Rollouts(Sampler(sampler.settings, sampler.seeds, sampler.pad_token_id, engine=self.engine),
                                 copy.deepcopy(module.tokenizer), module.environment, hp.max_turns,
                                 hp.max_episode_tokens)
        self.producer = RolloutProducer(self._draw, lambda job: self.server.unpin(POLICY, job.version), timeout,
                                        lambda: f"the vLLM server at {self.server.url}")
        self.snapshots: dict[int, tuple[int, dict[str, Tensor]]] = {}  # iteration -> its starting adapter
        self.started = False

    # ---- the schedule -------------------------------------------------------------------------------------

    def rollout(self, prompts: dict[str, Any]) -> tuple[Rollout, dict[str, Tensor]]:
        """The current iteration's rollout of ``prompts`` (the batch the loader handed out), drawn ahead; the
        rollout of iteration ``n + S`` submitted first. With the statistics of its age and of the wait."""
        module, n = self.module, self.module.iteration
        self.producer.check()
        with phase("rollout/generate"):  # the trainer's share of generation: submitting, then waiting
            if not self.started:  # a fresh run, or a resumed one: fill the pipeline
                self.started = True
                self.server.sync(module.model, POLICY, module.trainer.global_step)  # the version names the weights
                for iteration in range(n, n + self.staleness + 1):
                    self.submit(iteration, prompts if iteration == n else self.loader.ahead(iteration - n))
            else:
                self.submit(n + self.staleness, self.loader.ahead(self.staleness))
            start = time.perf_counter()
            job, rollout = self.producer.take(n)
            waited = time.perf_counter() - start
        rows = tuple(prompts["index"].tolist()) if "index" in prompts else ()
        if rows and job.rows != rows:
            raise RuntimeError(f"iteration {n + 1}: the rollout drawn ahead answers the rows {list(job.rows)}, but "
                               f"the loader handed out {list(rows)}")
        age = torch.tensor(float(n - job.drawn_by))
        return to_device(rollout, module.device), {
            "rollout/staleness_mean": age, "rollout/staleness_max": age,
            "rollout/staleness_steps": torch.tensor(float(module.trainer.global_step - job.version)),
            "time/rollout_wait": torch.tensor(waited)}

    def submit(self, iteration: int, prompts: dict[str, Any]) -> None:
        """Submit ``iteration``'s rollout of ``prompts``, drawn by the policy iteration ``max(0, iteration - S)``
        started from: the current adapter, or one kept for a resumed run."""
        module, n = self.module, self.module.iteration
        drawn_by = max(0, iteration - self.staleness)
        if drawn_by == n:
            version = module.trainer.global_step
            tensors = adapter_tensors(module.model, POLICY)  # FSDP2: gathered on every rank
            self.snapshots[n] = (version, tensors)
            name = self.server.serve_version(module.model, POLICY, version, tensors)
        elif drawn_by in self.snapshots:
            version, tensors = self.snapshots[drawn_by]
            name = self.server.serve_version(module.model, POLICY, version, tensors, current=False)
        else:
            raise RuntimeError(f"iteration {iteration + 1} is drawn by the policy of iteration {drawn_by + 1}, which "
                               f"the checkpoint does not hold (it keeps iterations {sorted(self.snapshots)}): resume "
                               "with the max_staleness the checkpoint was written with")
        for old in [kept for kept in self.snapshots if kept < n - self.staleness]:
            del self.snapshots[old]
        cpu = {key: value.cpu() if isinstance(value, Tensor) else value for key, value in prompts.items()}
        group = module.hparams.samples_per_prompt
        seeds = module.sampler.seeds.ahead(iteration, module.global_rank, cpu.get("index"), len(cpu["prompt"]), group)
        rows = tuple(cpu["index"].tolist()) if "index" in cpu else ()
        self.producer.submit(Job(iteration, drawn_by, version, name, rows, tuple(seeds)), cpu)

    def _draw(self, job: Job, prompts: dict[str, Any]) -> Rollout:
        """On the producer's thread: ``job``'s rollout, from the version it names."""
        self.engine.name = job.name
        return self.rollouts.run(self.module.model, POLICY, prompts, self.module.hparams.samples_per_prompt,
                                 f"train {job.iteration}", first_turn_seeds=list(job.seeds))

    @property
    def loader(self) -> Any:
        loaders = self.module.trainer.train_dataloader
        loader = loaders["prompts"] if isinstance(loaders, dict) else loaders
        if not hasattr(loader, "ahead"):
            raise TypeError(f"max_staleness needs a training loader that can hand out its next batches ahead "
                            f"(rlhf_lightning.data.loader.ResumableLoader), not {type(loader).__name__}")
        return loader

    # ---- checkpoints --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run redraws the untrained rollouts from: the adapters of the policies that drew them."""
        return {"staleness": self.staleness,
                "snapshots": {iteration: {"version": version, "tensors": tensors}
                              for iteration, (version, tensors) in self.snapshots.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.snapshots = {int(iteration): (int(kept["version"]), kept["tensors"])
                          for iteration, kept in state["snapshots"].items()}
        self.started = False

    def close(self) -> None:
        self.producer.close()


class OverlapHooks:
    """The module's side of asynchronous training, for :class:`~rlhf_lightning.core.collect.ExperienceCollector`
    (which refuses ``max_staleness`` > 0 where its engine cannot overlap): the :class:`Overlap` made at the first
    training rollout, its state in checkpoints, and its end with the fit."""

    _overlap: Overlap | None = None

    @property
    def overlap(self) -> Overlap | None:
        """The fixed-lag schedule of ``max_staleness`` > 0 (made at the first training rollout); None when
        synchronous."""
        if self._overlap is None and self.hparams.max_staleness and self.model is not None:
            self._overlap = Overlap(self, self.hparams.max_staleness, self.hparams.rollout_timeout)
        return self._overlap

    def training_rollout(self, prompts: dict[str, Any], group: int) -> tuple[Rollout, dict[str, Tensor]]:
        """The current training iteration's rollout of ``group`` responses to each prompt, with statistics: drawn
        now, or drawn ahead by the policy of ``max_staleness`` iterations ago (and the statistics of its age)."""
        if self.overlap is not None:
            return self.overlap.rollout(prompts)
        with phase("rollout/generate"):
            return self.rollouts.run(self.model, POLICY, prompts, group, f"train {self.iteration}"), {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.overlap is not None:
            checkpoint[STATE_KEY] = self.overlap.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.overlap is not None:
            if STATE_KEY not in checkpoint:
                where = self.trainer.ckpt_path if self._trainer is not None else "the checkpoint"
                raise CheckpointError(f"{where}: written by a synchronous run, which kept no adapters to redraw "
                                      "the rollouts drawn ahead from; resume it with max_staleness: 0")
            self.overlap.load_state_dict(checkpoint[STATE_KEY])

    def teardown(self, stage: str) -> None:
        if self._overlap is not None:
            self._overlap.close()
            self._overlap = None
        super().teardown(stage)


def to_device(rollout: Rollout, device: torch.device) -> Rollout:
    """``rollout`` with its tensors on ``device``."""
    return dataclasses.replace(rollout, **{field.name: getattr(rollout, field.name).to(device)
                                           for field in dataclasses.fields(rollout)
                                           if isinstance(getattr(rollout, field.name), Tensor)})
