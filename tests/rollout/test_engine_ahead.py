"""Drawing ahead is an engine capability: an engine of one's own that declares it (``ahead_refusal`` None,
``serve_version`` handing out an immutable :class:`~rlhf_lightning.rollout.engines.PolicyVersion`) trains a GRPO
run at ``asynchronous.max_staleness: 1`` with nothing else changed; the producer draws from the handles on its own
thread and releases each one; an engine without the capability is refused in one line."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from peft import get_peft_model, set_peft_model_state_dict
from torch import Tensor
from transformers import AutoModelForCausalLM

from rlhf_lightning.cli import main
from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.engines import EagerDecoder, Engine, EngineSetup, PolicyVersion
from rlhf_lightning.rollout.settings import SamplingSettings
from rlhf_lightning.rollout.vllm_support import adapter_tensors
from tests.helpers.cli import grpo, one_line


@dataclass(frozen=True)
class CopiedVersion(PolicyVersion):
    """A version of the policy: a copy of the peft model with that version's adapter active, drawn from token by
    token (a full forward pass per token, a generator of its own)."""

    engine: CopiedVersions
    tensors: dict[str, Tensor]  # the version's adapter, as peft saves it
    version: int

    def draw(self, model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        CopiedVersions.events.append(("draw", self.version, threading.current_thread().name))
        generator = torch.Generator().manual_seed(int(seeds[0]))  # never the global stream: it is the trainer's
        sequences, mask = input_ids.repeat_interleave(group, 0), attention_mask.repeat_interleave(group, 0)
        prompt_length, logprobs = sequences.shape[1], []
        copied = self.engine.copied
        with torch.no_grad(), self.engine.lock:
            set_peft_model_state_dict(copied, self.tensors, adapter_name=POLICY)
            for _ in range(settings.max_new_tokens):
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = copied(input_ids=sequences, attention_mask=mask, position_ids=positions).logits
                scores = torch.log_softmax(logits[:, -1].float() / settings.temperature, -1)
                token = torch.multinomial(scores.exp(), 1, generator=generator)
                logprobs.append(scores.gather(-1, token))
                sequences, mask = torch.cat([sequences, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
        return sequences[:, prompt_length:], torch.cat(logprobs, 1)

    def release(self) -> None:
        CopiedVersions.events.append(("release", self.version, threading.current_thread().name))


class CopiedVersions(EagerDecoder):
    """An engine of a user's own that draws ahead in the trainer's process: each version it serves is a copy of the
    peft model with that version's adapter (a CPU stand-in for a server holding adapter versions by name)."""

    events: list[tuple] = []  # class-level: the CLI builds the instance

    def __init__(self) -> None:
        super().__init__()
        self.base: str | None = None
        self.copied: Any = None  # its own copy of the base with the policy adapter, made at the first version
        self.lock = threading.Lock()

    def prepare(self, setup: EngineSetup) -> None:
        self.base = setup.name_or_path

    def ahead_refusal(self, staleness: int) -> str | None:
        return None

    def keep_versions(self, staleness: int) -> None:
        CopiedVersions.events.append(("keep", staleness, None))

    def serve_version(self, model: SharedBase, role: str, version: int, tensors: dict[str, Tensor] | None = None,
                      current: bool = True) -> PolicyVersion:
        if self.copied is None:
            config = copy.deepcopy(model.model.peft_config[role])
            self.copied = get_peft_model(AutoModelForCausalLM.from_pretrained(self.base), config, adapter_name=role)
            self.copied.eval()
        tensors = adapter_tensors(model, role) if tensors is None else tensors
        CopiedVersions.events.append(("serve", version, tensors))
        return CopiedVersion(self, tensors, version)


ENGINE = "--model.init_args.engine=tests.rollout.test_engine_ahead.CopiedVersions"


def test_an_engine_of_ones_own_that_declares_the_capability_trains_drawing_one_iteration_ahead(
        tiny_model_dir, reward_dir, tmp_path):
    CopiedVersions.events.clear()
    main(grpo(tiny_model_dir, reward_dir, ENGINE, "--model.init_args.asynchronous.max_staleness=1",
              "--trainer.limit_train_batches=3", "--model.init_args.update.epochs=2",
              f"--trainer.default_root_dir={tmp_path}"))
    events = CopiedVersions.events
    assert events[0] == ("keep", 1, None)  # told before the fit how old a drawn version can be
    served = [(version, tensors) for kind, version, tensors in events if kind == "serve"]
    # iterations 1 and 2 drawn by the starting policy (version 0), iteration n + 1 by iteration n's (4 optimizer
    # steps an iteration: 2 epochs of 2 minibatches); the third iteration submits the fourth's, never trained on
    assert [version for version, _ in served] == [0, 0, 4, 8]
    first, second, third, _ = (tensors for _, tensors in served)
    assert all((first[name] == second[name]).all() for name in first)
    assert any((first[name] != third[name]).any() for name in first)  # the policy trained in between
    draws = [(version, thread) for kind, version, thread in events if kind == "draw"]
    assert [version for version, _ in draws][:3] == [0, 0, 4]
    assert all(thread.startswith("rollout-producer") for _, thread in draws)  # never on the trainer's thread
    deadline = time.monotonic() + 30  # a job still being drawn when the fit ended releases its version after
    while len([kind for kind, _, _ in events if kind == "release"]) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    released = [version for kind, version, _ in events if kind == "release"]
    assert sorted(released) == [0, 0, 4, 8]  # every handle released: drawn, or dropped when the fit ends


def test_an_engine_without_the_capability_is_refused_in_one_line(tiny_model_dir, reward_dir, capsys):
    line = one_line(capsys, *grpo(tiny_model_dir, reward_dir, "--model.init_args.engine=EagerDecoder",
                                  "--model.init_args.asynchronous.max_staleness=1"))
    assert "asynchronous.max_staleness=1: the engine EagerDecoder draws in the trainer's own process" in line
    assert "use an engine that draws ahead" in line
    with pytest.raises(NotImplementedError, match="the engine Engine does not draw ahead"):
        Engine().serve_version(None, "policy", 0)


def test_an_engine_keeping_the_old_method_name_is_refused_when_defined():
    with pytest.raises(TypeError, match=r"^OldEngine\.overlap_refusal: the fit no longer reads 'overlap_refusal'; "
                                        r".*ahead_refusal\(staleness\)"):
        type("OldEngine", (Engine,), {"overlap_refusal": lambda self, staleness: None})
