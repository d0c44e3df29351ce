"""Samples of the whole pipeline (SFT, reward model, an algorithm), each stage one ``python -m rlhf_lightning fit``
subprocess with its own thread count, as a user runs them (see :mod:`rlhf_lightning.study.spread`).

A *sample* is a seed (``--seed_everything`` and ``--data.init_args.seed``) and a thread count (``OMP_NUM_THREADS``:
it changes float rounding, so a run's numbers). Each stage writes into a folder named by its stage, its settings
and the sample, so stages are shared where they can be: the SFT model of ``seed 3, 1 thread`` serves every reward
variant and algorithm of that sample. A stage that finished has ``done.json`` beside its outputs and is never run
again; a folder without it (a killed run) is removed and the stage run again from its start.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DONE = "done.json"


@dataclass(frozen=True)
class Sample:
    """One sample of the pipeline: a seed of every stage and the thread count every stage runs with."""

    seed: int
    threads: int

    @property
    def name(self) -> str:
        return f"seed{self.seed}-threads{self.threads}"


@dataclass(frozen=True)
class Stage:
    """A stage of the pipeline: its config, what it needs from earlier stages and the overrides of this study.

    Args:
        name: the stage (``sft``, ``reward``, ``ppo``...): the first part of its folder's name.
        config: the shipped config it runs (``configs/ppo.yaml``).
        needs: the stages whose outputs it reads, by their keys in the pipeline (an ``sft`` stage gives the base; a
            ``reward`` stage the reward source).
        overrides: further command-line arguments of every run of this stage.
        tag: the folder's name for these overrides (default: a hash of them; none without overrides).
        kind: what the stage is, ``sft``, ``reward`` or an algorithm (default: ``name``): what it hands on.
    """

    name: str
    config: str
    needs: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()
    tag: str | None = None
    kind: str | None = None

    @property
    def folder_name(self) -> str:
        if not self.overrides:
            return self.name
        tag = self.tag or hashlib.sha256("\n".join(self.overrides).encode()).hexdigest()[:8]
        return f"{self.name}-{tag}"


# Where a stage's output lies in its run folder, and the argument that hands it to a later stage.
OUTPUTS = {
    "sft": ("model", "--model.init_args.base.name_or_path"),
    "reward": ("adapters/reward", "--model.init_args.reward.init_args.path"),
}


@dataclass
class Pipeline:
    """The stages of one study and where their runs go.

    Args:
        out: the study's folder; a stage's run of a sample is ``out/<stage folder>/<sample>``.
        stages: the stages by name, each after the ones it needs.
        python: the interpreter that runs the stages.
    """

    out: Path
    stages: dict[str, Stage]
    python: str = sys.executable
    log: list[str] = field(default_factory=list)

    def folder_name(self, stage: str) -> str:
        """The stage's folder: its own name and tag, then the folders of the varied stages it builds on
        (``ppo@reward-clip1``), so that a run on a varied reward model is never taken for one on the shipped one."""
        spec = self.stages[stage]
        needed = [(self.folder_name(need), self.stages[need].name) for need in spec.needs]
        return "@".join([spec.folder_name, *(folder for folder, name in needed if folder != name)])

    def folder(self, stage: str, sample: Sample) -> Path:
        return self.out / self.folder_name(stage) / sample.name

    def is_done(self, stage: str, sample: Sample) -> bool:
        return (self.folder(stage, sample) / DONE).exists()

    def kind(self, stage: str) -> str:
        return self.stages[stage].kind or self.stages[stage].name

    def output(self, stage: str, sample: Sample) -> Path:
        """What ``stage`` hands on to later stages (the SFT model, the reward adapter) for ``sample``."""
        return self.folder(stage, sample) / OUTPUTS[self.kind(stage)][0]

    def command(self, stage: str, sample: Sample) -> list[str]:
        """The ``fit`` command of ``stage`` on ``sample``: the shipped config, the sample's seeds, the run folder, the
        earlier stages' outputs, then the study's overrides (which win; ``{sft}`` and ``{reward}`` in them stand for
        those stages' outputs of this sample)."""
        spec = self.stages[stage]
        outputs = {self.kind(need): str(self.output(need, sample)) for need in spec.needs}
        needs = [f"{OUTPUTS[kind][1]}={path}" for kind, path in outputs.items()]
        overrides = [argument.replace("{sft}", outputs.get("sft", "{sft}")).replace("{reward}",
                                                                                   outputs.get("reward", "{reward}"))
                     for argument in spec.overrides]
        return [self.python, "-m", "rlhf_lightning", "fit", "--config", spec.config,
                f"--seed_everything={sample.seed}", f"--data.init_args.seed={sample.seed}",
                f"--trainer.default_root_dir={self.folder(stage, sample)}", *needs, *overrides]

    def run(self, stage: str, sample: Sample) -> float:
        """Run ``stage`` on ``sample`` (after the stages it needs) unless done; its wall seconds (of the run that
        made it, read back from ``done.json`` when it was done before)."""
        for need in self.stages[stage].needs:
            self.run(need, sample)
        folder = self.folder(stage, sample)
        if self.is_done(stage, sample):
            return json.loads((folder / DONE).read_text())["seconds"]
        if folder.exists():  # a run that was killed: run it again from the start, as the sample's stage would be
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        command = self.command(stage, sample)
        threads = str(sample.threads)
        environment = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        started = time.perf_counter()
        with (folder / "output.txt").open("w") as output:
            finished = subprocess.run(command, env=environment, stdout=output, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - started
        if finished.returncode != 0:
            tail = (folder / "output.txt").read_text().strip().splitlines()[-3:]
            raise RuntimeError(f"{stage} of {sample.name} failed (exit {finished.returncode}); its output: "
                               f"{folder / 'output.txt'}: {' | '.join(tail)}")
        (folder / DONE).write_text(json.dumps({"seconds": seconds, "command": command[1:], "threads": sample.threads},
                                              indent=1))
        return seconds
