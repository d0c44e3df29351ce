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

LoRA layers use our fused forward (``rlhf_lightning.ops.lora``), GPT-2's GELU the fused kernel and the
log-probs our fused LM head (``rlhf_lightning.ops.lm_head``), as on our side: the floor is the bare work done
the fastest way we know, not peft's or transformers' defaults.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from harness.fixtures import lora_spec, prompt_ids
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


def _sequences(settings: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention mask)``, ``[rollout_rows, prompt + response]``: each prompt repeated once per response to
    it, random responses; for DPO the chosen rows then the rejected rows, the shorter responses right-padded."""
    prompts = prompt_ids(settings, settings.prompts).repeat_interleave(settings.rollout_rows // settings.prompts, 0)
    lengths = [settings.response_length] * settings.rollout_rows
    if isinstance(settings, DPOSettings):
        lengths = [settings.response_length] * settings.prompts + [settings.rejected_length] * settings.prompts
    width = max(lengths)
    responses = torch.randint(0, settings.vocab_words - 1, (settings.rollout_rows, width),
                              generator=torch.Generator().manual_seed(settings.seed + 2))
    response_mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    mask = torch.cat([torch.ones_like(prompts), response_mask.long()], 1)
    return torch.cat([prompts, responses], 1).to(settings.device), mask.to(settings.device)


def _piece(settings: Settings, name: str) -> Callable[[], None]:
    """Build the models of piece ``name`` and return a function doing its work once."""
    from rlhf_lightning.ops.lm_head import (
        logprobs_from_hidden,  # here: a parent reads PIECES without the package
    )

    model = load_base_model(settings).to(settings.device)
    model.requires_grad_(False)
    hidden = model.config.n_embd
    sequences, mask = _sequences(settings)
    response = sequences.shape[1] - settings.prompt_length
    labels = sequences[:, -response:]
    response_mask = mask[:, -response:]

    def logprobs(decoder_out: torch.Tensor, targets: torch.Tensor = labels) -> torch.Tensor:
        # Our fused head (the fastest way we know): no [N, V] logits kept beside their softmax.
        return logprobs_from_hidden(decoder_out[:, -response - 1: -1], model.lm_head.weight, targets)[0]

    if name == "generate":
        from transformers import GenerationConfig

        from rlhf_lightning.ops.sampling import sampling_processors

        config = GenerationConfig(do_sample=False, max_new_tokens=response, min_new_tokens=0, eos_token_id=[],
                                  pad_token_id=model.config.pad_token_id, cache_implementation="static",
                                  disable_compile=True)
        prompts = sequences[:, : settings.prompt_length]

        @torch.no_grad()
        def work() -> None:
            with _autocast(settings):
                model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=config,
                               logits_processor=sampling_processors())

        return work
    grpo, dpo = isinstance(settings, GRPOSettings), isinstance(settings, DPOSettings)
    peft_model = _peft_model(settings, model, () if grpo or dpo else ("critic", "reward"))
    decoder = peft_model.get_base_model().transformer
    heads = {role: torch.nn.Linear(hidden, 1).to(settings.device) for role in ("critic", "reward")}

    if name == "reference":
        @torch.no_grad()
        def work() -> None:
            with _autocast(settings), peft_model.disable_adapter():
                out = decoder(input_ids=sequences, attention_mask=mask).last_hidden_state
                (logprobs(out) * response_mask).sum(-1)

        return work
    if name == "score":
        @torch.no_grad()
        def work() -> None:
            with _autocast(settings):
                with peft_model.disable_adapter():
                    logprobs(decoder(input_ids=sequences, attention_mask=mask).last_hidden_state)
                for role in ("critic", "reward"):
                    peft_model.set_adapter(role)
                    out = decoder(input_ids=sequences, attention_mask=mask).last_hidden_state
                    heads[role](out[:, -response - 1:].float())

        return work
    role = "policy" if name == "policy_update" else "critic"
    peft_model.set_adapter(role)
    trainable = [p for n, p in peft_model.named_parameters() if f".{role}." in n and "lora_" in n]
    for parameter in trainable:
        parameter.requires_grad_(True)
    if role == "critic":
        trainable += list(heads["critic"].parameters())
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr)
    target = torch.randn(sequences.shape[0], response, device=settings.device)
    # GRPO's floor steps on each minibatch, as both GRPO sides do; PPO's has always made one full-batch step per
    # epoch (the same forward and backward work; num_minibatches - 1 fewer AdamW steps).
    minibatches, passes = [slice(None)], 1 if dpo else settings.ppo_epochs
    reference_sums = torch.randn(2, settings.prompts, device=settings.device) if dpo else None  # given
    if grpo:
        size = sequences.shape[0] // settings.num_minibatches
        minibatches = [slice(index * size, (index + 1) * size) for index in range(settings.num_minibatches)]

    def work() -> None:
        for _ in range(passes):
            for rows in minibatches:
                with _autocast(settings):
                    out = decoder(input_ids=sequences[rows], attention_mask=mask[rows]).last_hidden_state
                    if dpo:
                        chosen, rejected = (logprobs(out) * response_mask).sum(-1).view(2, -1) - reference_sums
                        loss = -torch.nn.functional.logsigmoid(settings.beta * (chosen - rejected)).mean()
                    elif role == "policy":
                        loss = -(logprobs(out, labels[rows]) * target[rows]).mean()
                    else:
                        values = heads["critic"](out[:, -response - 1: -1].float()).squeeze(-1)
                        loss = (values - target[rows]).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    return work


def run(settings: Settings, side: str) -> None:
    """Time piece ``side`` (``floor/<piece>``) in this process and report it."""
    name = side.removeprefix("floor/")
    configure_threads(settings)
    torch.manual_seed(settings.seed)
    work = _piece(settings, name)
    watch = Stopwatch(settings.device)
    rows = []
    for index in range(settings.warmup + settings.iterations):
        start = watch.now()
        work()
        if index >= settings.warmup:
            rows.append({"seconds": watch.now() - start})
    report({"side": f"floor/{name}", "iterations": rows})
