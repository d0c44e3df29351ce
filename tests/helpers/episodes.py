"""Episodes on the calculator task: the model, an environment, a module and a batch."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_lightning import PPO, FunctionReward
from rlhf_lightning.environments import Environment, Step
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.tasks.calculator import build_tokenizer, correct_answer
from tests.helpers.models import LORA, built, make_likely
from tests.helpers.modules import merged
from tests.helpers.online import prompts


class Feedback(Environment):
    """Answers every turn with feedback and a reward of 0.25, never ends: episodes run to episodes.max_turns."""

    def step(self, messages):
        return Step([{"role": "user", "content": "try again"}], reward=0.25)


@pytest.fixture(scope="module")
def calculator_model_dir(tmp_path_factory):
    """A tiny random GPT-2 with the calculator task's tokenizer (ChatML-style template with tool calls)."""
    directory = tmp_path_factory.mktemp("calculator-gpt2")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_embd=32, n_head=2, n_positions=160,
                                       pad_token_id=tokenizer.pad_token_id))
    # Random weights would end a turn once in ~60 tokens: point the turn-end token's (tied) embedding along the
    # average final hidden state, so that turns end after a few tokens and episodes take several turns.
    make_likely(model, tokenizer.convert_tokens_to_ids("<|im_end|>"), 4.0, len(tokenizer), 24)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def episodic(algorithm, directory, **kwargs):
    """``algorithm`` built on the calculator's model, its episodes answered by :class:`Feedback` (3 turns, 40 tokens
    at most) unless ``kwargs`` give ``episodes={...}`` fields of their own (merged field by field)."""
    settings = merged(dict(base=BaseModelSpec(name_or_path=str(directory)), policy_lora=LORA,
                           sampling={"max_new_tokens": 6}, reward=FunctionReward(correct_answer),
                           episodes={"environment": Feedback, "max_turns": 3, "max_tokens": 40},
                           samples_per_prompt=2), kwargs)
    if algorithm is PPO:
        settings.update(critic={"lora": LORA})
    module = built(algorithm(**settings))
    module.policy.rollouts  # noqa: B018 (the environment and the template's tool-call format, read once)
    return module


def calculator_batch(module, n=4):
    return next(iter(prompts(module, n=n, dataset="calculator", batch_size=n).train_dataloader()["prompts"]))
