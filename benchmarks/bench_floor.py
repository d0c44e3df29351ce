"""The floor: the bare pieces of work a PPO iteration on these shapes cannot avoid, with no framework around them.

Each piece runs alone in a fresh process (so its peak memory is its own):

- ``generate``: one sampled ``generate`` with a KV cache for the batch, through the plain base (what a policy
  with its LoRA merged costs), with the fastest settings we know: a static cache and our inverse-CDF sampler;
- ``score``: the no-grad passes before the update: reference log-probs (LM head on response positions only),
  the critic's values and the reward model's score (each a LoRA adapter on the base); the old log-probs are
  taken to come free with sampling;
- ``policy_update`` and ``critic_update``: ``ppo_epochs`` x (forward + backward + AdamW step) through the base
  with the policy's LoRA (and the LM head on response positions) or the critic's LoRA and value head.

GRPO's floor (``GRPO_PIECES``, on ``prompts x group_size`` responses): ``generate``; ``reference``, the reference
log-probs (adapters off; only at beta > 0); ``policy_update``, ``ppo_epochs x num_minibatches`` x (forward +
backward + AdamW step) on the minibatches through the base with the policy's LoRA. The old log-probs (needed when
there is more than one optimizer step) are again taken to come free with sampling, and the reward is a function
(no pass).

DPO's floor (``DPO_PIECES``, on ``2 x pairs`` rows: every chosen response, then every rejected one, the shorter
right-padded to the longer): ``reference``, the reference's summed log-probs (adapters off; gone when they are
precomputed); ``policy_update``, one forward + backward + AdamW step of DPO's sigmoid loss through the base with
the policy's LoRA.

Under ``--lengths task`` or ``long-tail`` (``harness.lengths``), ``generate`` stops each row at the EOS the plan
forces (the same processor as every side's) and the other pieces run on responses of the planned lengths, a
different set each iteration as on every side; each pass is cut to its rows' longest response (GRPO's minibatches
each to their own).

LoRA layers use our fused forward (``rlhf_lightning.ops.lora``), GPT-2's GELU the fused kernel and the
log-probs our fused LM head (``rlhf_lightning.ops.lm_head``), as on our side: the floor is the bare work done
the fastest way we know, not peft's or transformers' defaults.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from harness.fixtures import lora_spec, prompt_ids
from harness.lengths import StopPlan, eos_id, planned_lengths
from harness.measure import Stopwatch
from harness.processes import report
from harness.settings import DPOSettings, GRPOSettings, Settings
from harness.sides import configure_threads, load_base_model

PIECES = ("generate", "score", "policy_update", "critic_update")
GRPO_PIECES = ("generate", "reference", "policy_update")
DPO_PIECES = ("reference", "policy_update")


def split(summary: dict[str, dict[str, Any]], floors: dict[str, Iterable[str]], memory_key: str
          ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """``(summary without its floor/<piece> entries, {floor name: the floor made of its pieces})``. A floor's
    seconds are its pieces' added up, its peak the largest piece's; it is empty when none of its pieces ran."""
    made = {}
    for name, pieces in floors.items():
        parts = {piece: summary[f"floor/{piece}"] for piece in pieces if f"floor/{piece}" in summary}
        made[name] = {"seconds": sum(p["seconds"] for p in parts.values()),
                      "peak": max(p[memory_key] for p in parts.values()),
                      "pieces": {piece: p["seconds"] for piece, p in parts.items()}} if parts else {}
    return {side: entry for side, entry in summary.items() if not side.startswith("floor/")}, made


def _autocast(settings: Settings):
    if settings.precision == "bf16-mixed":
        return torch.autocast(settings.device.split(":")[0], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _peft_model(settings: Settings, model, others: tuple[str, ...] = ("critic", "reward")):
    from peft import get_peft_model

    from rlhf_lightning.ops.lora import fuse_lora_layers

    config = lora_spec(settings).to_peft(fan_in_fan_out=True)
    peft_model = get_peft_model(model, config, adapter_name="policy")
    for name in others:
        peft_model.add_adapter(name, lora_spec(settings).to_peft(fan_in_fan_out=True))
    fuse_lora_layers(peft_model)
    return peft_model


@dataclass(frozen=True)
class Batch:
    """One rollout's sequences ``[rows, prompt + response]``: prompts, then right-padded responses."""

    sequences: torch.Tensor
    mask: torch.Tensor
    prompt: int

    @property
    def response(self) -> int:
        """Response columns: the longest response's tokens."""
        return self.sequences.shape[1] - self.prompt

    @property
    def labels(self) -> torch.Tensor:
        return self.sequences[:, self.prompt:]

    @property
    def response_mask(self) -> torch.Tensor:
        return self.mask[:, self.prompt:]

    def cut(self, rows: slice) -> Batch:
        """Rows ``rows``, cut to the columns of their longest response (the padding no pass needs)."""
        width = self.prompt + int(self.response_mask[rows].sum(-1).max())
        return Batch(self.sequences[rows, :width], self.mask[rows, :width], self.prompt)


def _sequences(settings: Settings, rollout: int = 0) -> Batch:
    """Rollout ``rollout``'s sequences, ``rollout_rows`` of them: each prompt repeated once per response to it,
    random responses of the planned lengths (``harness.lengths``; all ``response_length`` under ``--lengths
    equal``); for DPO the chosen rows then the rejected rows, the shorter responses right-padded."""
    prompts = prompt_ids(settings, settings.prompts).repeat_interleave(settings.rollout_rows // settings.prompts, 0)
    lengths = planned_lengths(settings, rollout)
    if isinstance(settings, DPOSettings):
        lengths = [settings.response_length] * settings.prompts + [settings.rejected_length] * settings.prompts
    width = max(lengths)
    responses = torch.randint(0, settings.vocab_words - 1, (settings.rollout_rows, width),
                              generator=torch.Generator().manual_seed(settings.seed + 2))
    response_mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    mask = torch.cat([torch.ones_like(prompts), response_mask.long()], 1)
    return Batch(torch.cat([prompts, responses], 1).to(settings.device), mask.to(settings.device),
                 settings.prompt_length)


def _batches(settings: Settings) -> Callable[[int], Batch]:
    """Iteration ``index``'s batch: under ``--lengths equal`` one batch for every iteration, else the responses'
    lengths planned for that rollout (as every side samples them)."""
    count = 1 if settings.lengths == "equal" else settings.warmup + settings.iterations
    batches = [_sequences(settings, rollout) for rollout in range(count)]
    return lambda index: batches[index % count]


def _piece(settings: Settings, name: str, plan: StopPlan) -> Callable[[int], None]:
    """Build the models of piece ``name`` and return a function doing its work once (given the iteration's
    index); ``plan``: the stops ``generate`` forces (under ``--lengths`` other than ``equal``)."""
    from rlhf_lightning.ops.lm_head import (
        logprobs_from_hidden,  # here: a parent reads PIECES without the package
    )

    model = load_base_model(settings).to(settings.device)
    model.requires_grad_(False)
    hidden = model.config.n_embd
    batch_of = _batches(settings)

    def logprobs(decoder_out: torch.Tensor, batch: Batch) -> torch.Tensor:
        # Our fused head (the fastest way we know): no [N, V] logits kept beside their softmax.
        return logprobs_from_hidden(decoder_out[:, -batch.response - 1: -1], model.lm_head.weight, batch.labels)[0]

    if name == "generate":
        from transformers import GenerationConfig

        from rlhf_lightning.ops.sampling import sampling_processors

        stops = settings.lengths != "equal"
        config = GenerationConfig(do_sample=False, max_new_tokens=settings.response_length, min_new_tokens=0,
                                  eos_token_id=[eos_id(settings)] if stops else [],
                                  pad_token_id=model.config.pad_token_id, cache_implementation="static",
                                  disable_compile=True)
        prompts = batch_of(0).sequences[:, : settings.prompt_length]

        @torch.no_grad()
        def work(index: int) -> None:
            processors = sampling_processors()
            if stops:  # before the sampler, which turns the scores into its one-hot choice
                processors.insert(0, plan.next_processor())
            with _autocast(settings):
                sequences = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                           generation_config=config, logits_processor=processors)
            if stops:
                plan.record(sequences[:, settings.prompt_length:])

        return work
    grpo, dpo = isinstance(settings, GRPOSettings), isinstance(settings, DPOSettings)
    peft_model = _peft_model(settings, model, () if grpo or dpo else ("critic", "reward"))
    decoder = peft_model.get_base_model().transformer
    heads = {role: torch.nn.Linear(hidden, 1).to(settings.device) for role in ("critic", "reward")}

    if name == "reference":
        @torch.no_grad()
        def work(index: int) -> None:
            batch = batch_of(index)
            with _autocast(settings), peft_model.disable_adapter():
                out = decoder(input_ids=batch.sequences, attention_mask=batch.mask).last_hidden_state
                (logprobs(out, batch) * batch.response_mask).sum(-1)

        return work
    if name == "score":
        @torch.no_grad()
        def work(index: int) -> None:
            batch = batch_of(index)
            with _autocast(settings):
                with peft_model.disable_adapter():
                    logprobs(decoder(input_ids=batch.sequences, attention_mask=batch.mask).last_hidden_state, batch)
                for role in ("critic", "reward"):
                    peft_model.set_adapter(role)
                    out = decoder(input_ids=batch.sequences, attention_mask=batch.mask).last_hidden_state
                    heads[role](out[:, -batch.response - 1:].float())

        return work
    role = "policy" if name == "policy_update" else "critic"
    peft_model.set_adapter(role)
    trainable = [p for n, p in peft_model.named_parameters() if f".{role}." in n and "lora_" in n]
    for parameter in trainable:
        parameter.requires_grad_(True)
    if role == "critic":
        trainable += list(heads["critic"].parameters())
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr)
    target = torch.randn(settings.rollout_rows, settings.response_length, device=settings.device)
    # GRPO's floor steps on each minibatch, as both GRPO sides do, each cut to its own longest response; PPO's has
    # always made one full-batch step per epoch (the same forward and backward work; num_minibatches - 1 fewer
    # AdamW steps).
    minibatches, passes = [slice(None)], 1 if dpo else settings.ppo_epochs
    reference_sums = torch.randn(2, settings.prompts, device=settings.device) if dpo else None  # given
    if grpo:
        size = settings.rollout_rows // settings.num_minibatches
        minibatches = [slice(index * size, (index + 1) * size) for index in range(settings.num_minibatches)]

    def work(index: int) -> None:
        whole = batch_of(index)
        for _ in range(passes):
            for rows in minibatches:
                batch = whole.cut(rows)
                goal = target[rows, : batch.response]
                with _autocast(settings):
                    out = decoder(input_ids=batch.sequences, attention_mask=batch.mask).last_hidden_state
                    if dpo:
                        chosen, rejected = (logprobs(out, batch) * batch.response_mask).sum(-1).view(2, -1) - \
                            reference_sums
                        loss = -torch.nn.functional.logsigmoid(settings.beta * (chosen - rejected)).mean()
                    elif role == "policy":
                        loss = -(logprobs(out, batch) * goal).mean()
                    else:
                        values = heads["critic"](out[:, -batch.response - 1: -1].float()).squeeze(-1)
                        loss = (values - goal).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    return work


def run(settings: Settings, side: str) -> None:
    """Time piece ``side`` (``floor/<piece>``) in this process and report it."""
    name = side.removeprefix("floor/")
    configure_threads(settings)
    torch.manual_seed(settings.seed)
    plan = StopPlan(settings)
    work = _piece(settings, name, plan)
    watch = Stopwatch(settings.device)
    rows = []
    for index in range(settings.warmup + settings.iterations):
        start = watch.now()
        work(index)
        if index >= settings.warmup:
            rows.append({"seconds": watch.now() - start})
    lengths = {"lengths": plan.realised} if plan.realised else {}  # what generate sampled, under --lengths
    report({"side": f"floor/{name}", "iterations": rows, **lengths})
