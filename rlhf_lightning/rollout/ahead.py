"""Drawing ahead (asynchronous training with a fixed lag): the rollouts of the next ``asynchronous.max_staleness``
iterations are drawn while the policy trains, on an engine that draws ahead: one whose
:meth:`~rlhf_lightning.rollout.engines.Engine.ahead_refusal` is None and that hands out an immutable handle per
policy version (:meth:`~rlhf_lightning.rollout.engines.Engine.serve_version`), as ``VLLMServer`` does. This module
names no engine.

The schedule (``S`` = ``asynchronous.max_staleness``): iteration ``m`` trains on a rollout drawn by the policy that
iteration ``d(m) = max(0, m - S)`` started from. When iteration ``n`` starts, the rollout of iteration ``n + S`` is
submitted to the :class:`~rlhf_lightning.rollout.producer.RolloutProducer`, drawn by the current adapter, on the
prompts the training loader will hand out then (:meth:`~rlhf_lightning.data.loader.ResumableLoader.ahead`, which reads
each batch once: the trainer is handed the very batch the producer drew from); iteration
``n`` takes its own rollout, submitted ``S`` iterations earlier (the first ``S`` iterations of a run are drawn by the
starting policy, all at once). This is the admission bound of AReaL and SkyRL (at policy version ``v``, at most
``(S + v + 1) B`` prompts admitted) at the granularity of a batch; nothing is dropped.

A run is a function of its seed: every request's seed comes from the run's streams
(:meth:`~rlhf_lightning.rollout.seeds.Seeds.ahead`, the synchronous loop's own seeds for the iteration), the
prompts from the loader's seeded order, the weights from the schedule. A checkpoint holds the adapters of the
policies the untrained rollouts were drawn by (the last ``S + 1`` iterations' starting adapters, LoRA weights only);
a resumed run hands them to the engine again and redraws those rollouts, the same requests as before, so it goes
on as the uninterrupted run would have.

After the rollout, everything is as in the synchronous loop: the trainer's log-probs (the proximal policy, the
policy at the start of the update), the reference's, the rewards and the algorithm's passes are made at the
iteration that trains, on its current weights; the sampler's log-probs are the behaviour policy's.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.engines import Engine
from rlhf_lightning.rollout.producer import Job, RolloutProducer
from rlhf_lightning.rollout.rollouts import Rollout, Rollouts
from rlhf_lightning.rollout.sampler import Sampler
from rlhf_lightning.rollout.vllm_support import adapter_tensors
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.atomic_io import CheckpointError
from rlhf_lightning.utils.timing import phase


@dataclasses.dataclass(frozen=True)
class Asynchronous:
    """The ``asynchronous`` argument of every online module: drawing the rollouts of the coming iterations while the
    policy trains (``docs/async.md``).

    Args:
        max_staleness: the rollouts of the next ``max_staleness`` iterations are drawn while the policy trains
            (iteration n on the policy iteration n - max_staleness started from), on an engine that draws ahead
            (``VLLMServer``); 0 = the synchronous loop.
        rollout_timeout: seconds an iteration waits for its rollout drawn ahead before the fit stops.
    """

    max_staleness: int = 0
    rollout_timeout: float = 1800.0

    def check(self, name: str = "asynchronous") -> Asynchronous:
        """Raise a one-line error naming ``name.field`` for a value out of range."""
        checks.at_least(f"{name}.max_staleness", self.max_staleness, minimum=0)
        checks.positive(f"{name}.rollout_timeout", self.rollout_timeout)
        return self

    def prepare(self, engine: Engine) -> None:
        """With ``max_staleness`` > 0: refuse, in one line, an engine that cannot draw ahead
        (:meth:`Engine.ahead_refusal`); let one that can keep the versions it serves (:meth:`Engine.keep_versions`)."""
        if self.max_staleness:
            if refusal := engine.ahead_refusal(self.max_staleness):
                raise ValueError(refusal)
            engine.keep_versions(self.max_staleness)


STATE_KEY = "rollouts_ahead"  # a checkpoint's entry: the adapters the untrained rollouts were drawn by
POLICY = "policy"  # the adapter drawn from (rlhf_lightning.core.policy.POLICY)


class DrawAhead:
    """The fixed-lag schedule of a fit's training rollouts (see the module docstring).

    Args:
        rollouts: the fit's turn loop; the producer draws with a copy of it on each job's version of the policy (a
            sampler of its own, and a tokenizer of its own: a fast tokenizer used by two threads at once can fail,
            "Already borrowed").
        model: the shared base whose policy adapter is drawn from (its engine must draw ahead).
        group: responses drawn per prompt (``samples_per_prompt``).
        rank: this process's rank (the seeds of its requests).
        staleness: ``asynchronous.max_staleness``, at least 1.
        timeout: seconds the trainer waits for a rollout before the fit stops (``asynchronous.rollout_timeout``).
    """

    def __init__(self, rollouts: Rollouts, model: SharedBase, group: int, rank: int, staleness: int,
                 timeout: float) -> None:
        self.group, self.rank, self.staleness = group, rank, staleness
        self.engine = rollouts.sampler.engine(model)  # the trainer's engine, which hands out the versions
        self.rollouts = Rollouts(rollouts.sampler, copy.deepcopy(rollouts.tokenizer), rollouts.environment,
                                 rollouts.max_turns, rollouts.max_tokens)  # each job draws with it on its version
        self.producer = RolloutProducer(self._draw, lambda job: job.source.release(), timeout, self.engine.where)
        self.model = model
        self.snapshots: dict[int, tuple[int, dict[str, Tensor]]] = {}  # iteration -> its starting adapter
        self.started = False

    # ---- the schedule -------------------------------------------------------------------------------------

    def rollout(self, prompts: dict[str, Any], iteration: int, step: int, coming: Callable[[int], dict[str, Any]],
                device: torch.device) -> tuple[Rollout, dict[str, Tensor]]:
        """Iteration ``iteration``'s rollout of ``prompts`` (the batch the loader handed out), drawn ahead, on
        ``device``; the rollout of iteration ``iteration + S`` submitted first, of the prompts ``coming(S)`` (the
        loader's batch ``S`` ahead). ``step``: the optimizer steps taken so far (the version of the current
        adapter). With the statistics of its age and of the wait."""
        n = iteration
        self.producer.check()
        with phase("rollout/generate"):  # the trainer's share of generation: submitting, then waiting
            if not self.started:  # a fresh run, or a resumed one: fill the pipeline
                self.started = True
                self.engine.sync(self.model, POLICY, step)  # the version names the weights
                for later in range(n, n + self.staleness + 1):
                    self.submit(later, prompts if later == n else coming(later - n), n, step)
            else:
                self.submit(n + self.staleness, coming(self.staleness), n, step)
            start = time.perf_counter()
            job, rollout = self.producer.take(n)
            waited = time.perf_counter() - start
        rows = tuple(prompts["index"].tolist()) if "index" in prompts else ()
        if rows and job.rows != rows:
            raise RuntimeError(f"iteration {n + 1}: the rollout drawn ahead answers the rows {list(job.rows)}, but "
                               f"the loader handed out {list(rows)}")
        age = torch.tensor(float(n - job.drawn_by))
        return to_device(rollout, device), {
            "rollout/staleness_mean": age, "rollout/staleness_max": age,
            "rollout/staleness_steps": torch.tensor(float(step - job.version)),
            "time/rollout_wait": torch.tensor(waited)}

    def submit(self, iteration: int, prompts: dict[str, Any], current: int, step: int) -> None:
        """Submit ``iteration``'s rollout of ``prompts``, drawn by the policy iteration ``max(0, iteration - S)``
        started from: the current adapter (iteration ``current``, after ``step`` optimizer steps), or one kept
        for a resumed run."""
        n = current
        drawn_by = max(0, iteration - self.staleness)
        if drawn_by == n:
            version = step
            tensors = adapter_tensors(self.model, POLICY)  # FSDP2: gathered on every rank
            self.snapshots[n] = (version, tensors)
            source = self.engine.serve_version(self.model, POLICY, version, tensors)
        elif drawn_by in self.snapshots:
            version, tensors = self.snapshots[drawn_by]
            source = self.engine.serve_version(self.model, POLICY, version, tensors, current=False)
        else:
            raise RuntimeError(f"iteration {iteration + 1} is drawn by the policy of iteration {drawn_by + 1}, which "
                               f"the checkpoint does not hold (it keeps iterations {sorted(self.snapshots)}): resume "
                               "with the asynchronous.max_staleness the checkpoint was written with")
        for old in [kept for kept in self.snapshots if kept < n - self.staleness]:
            del self.snapshots[old]
        cpu = {key: value.cpu() if isinstance(value, Tensor) else value for key, value in prompts.items()}
        seeds = self.rollouts.sampler.seeds.ahead(iteration, self.rank, cpu.get("index"), len(cpu["prompt"]), self.group)
        rows = tuple(cpu["index"].tolist()) if "index" in cpu else ()
        self.producer.submit(Job(iteration, drawn_by, source, rows, tuple(seeds)), cpu)

    def _draw(self, job: Job, prompts: dict[str, Any]) -> Rollout:
        """On the producer's thread: ``job``'s rollout, drawn from the version it holds."""
        sampler = self.rollouts.sampler
        drawn = self.rollouts.with_sampler(Sampler(sampler.settings, sampler.seeds, sampler.pad_token_id,
                                                   engine=job.source))
        return drawn.run(self.model, POLICY, prompts, self.group, f"train {job.iteration}",
                         first_turn_seeds=list(job.seeds))

    # ---- checkpoints --------------------------------------------------------------------------------------

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Keep in ``checkpoint`` what a resumed run redraws the untrained rollouts from: the adapters of the
        policies that drew them."""
        checkpoint[STATE_KEY] = {"staleness": self.staleness,
                                 "snapshots": {iteration: {"version": version, "tensors": tensors}
                                               for iteration, (version, tensors) in self.snapshots.items()}}

    def load(self, checkpoint: dict[str, Any], where: str) -> None:
        """Take back what :meth:`save` kept in ``checkpoint`` (read from ``where``); a synchronous run's is
        refused."""
        if STATE_KEY not in checkpoint:
            raise CheckpointError(f"{where}: written by a synchronous run, which kept no adapters to redraw the "
                                  "rollouts drawn ahead from; resume it with asynchronous.max_staleness: 0")
        self.snapshots = {int(iteration): (int(kept["version"]), kept["tensors"])
                          for iteration, kept in checkpoint[STATE_KEY]["snapshots"].items()}
        self.started = False

    def close(self) -> None:
        self.producer.close()


def loader_ahead(loaders: Any) -> Callable[[int], dict[str, Any]]:
    """The batch ``k`` ahead of the training loader's current one (of a Trainer's ``train_dataloader``: the
    ``prompts`` loader of a dict)."""
    loader = loaders["prompts"] if isinstance(loaders, dict) else loaders
    if not hasattr(loader, "ahead"):
        raise TypeError(f"asynchronous.max_staleness needs a training loader that can hand out its next batches ahead "
                        f"(rlhf_lightning.data.loader.ResumableLoader), not {type(loader).__name__}")
    return loader.ahead


def to_device(rollout: Rollout, device: torch.device) -> Rollout:
    """``rollout`` with its tensors on ``device``."""
    return dataclasses.replace(rollout, **{field.name: getattr(rollout, field.name).to(device)
                                           for field in dataclasses.fields(rollout)
                                           if isinstance(getattr(rollout, field.name), Tensor)})
