"""The package's files one training iteration of an online module goes through, in the order it first enters each
(what a reader of the iteration opens): ``python -m tests.helpers.reading_order [ALGORITHM]`` prints them for the
second iteration of a small fit on a tiny model (the first also builds the model and the engine).

A file counts when a function of it is called; the package's ``algorithms/`` (pure math) and ``utils/`` are listed
apart, since a reader follows the loop through ``core/``, ``rollout/``, ``rewards/``, ``models/`` and the stage."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import lightning as L

PACKAGE = Path(__file__).resolve().parents[2] / "rlhf_lightning"
SUPPORT = ("algorithms", "utils", "ops")


class FilesOfOneIteration(L.Callback):
    """Records the package files entered during training batch ``batch`` (their order of first entry)."""

    def __init__(self, batch: int = 1) -> None:
        self.batch, self.files = batch, []

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(str(PACKAGE)) and path not in self.files:
                self.files.append(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.batch:
            sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.batch:
            sys.setprofile(None)


def files_of_one_iteration(algorithm: str = "PPO") -> list[str]:
    """The package files (relative to it) of one iteration of ``algorithm`` (a class of ``rlhf_lightning``)."""
    import torch

    import rlhf_lightning as r
    from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
    from tests.helpers.models import save_reward_adapter, tiny_spec
    from tests.helpers.modules import make
    from tests.helpers.online import ONLINE_SETTINGS, prompts

    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "base"
        torch.manual_seed(0)
        tokenizer = load_tokenizer(tiny_spec())
        load_causal_lm(tiny_spec(), tokenizer).save_pretrained(base)
        tokenizer.save_pretrained(base)
        module = make(getattr(r, algorithm), base, save_reward_adapter(base, Path(folder) / "reward"),
                      defaults=ONLINE_SETTINGS)
        recorder = FilesOfOneIteration()
        trainer = L.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, callbacks=[recorder], default_root_dir=folder)
        trainer.fit(module, datamodule=prompts(module, n=8, batch_size=2))
    return [str(Path(path).relative_to(PACKAGE)) for path in recorder.files]


if __name__ == "__main__":
    files = files_of_one_iteration(*sys.argv[1:])
    loop = [name for name in files if name.split("/")[0] not in SUPPORT]
    print(f"{len(loop)} files of the loop, in the order an iteration enters them:")
    print("\n".join(f"  {name}" for name in loop))
    support = [name for name in files if name.split("/")[0] in SUPPORT]
    print(f"and {len(support)} of math and utilities: {', '.join(support)}")
