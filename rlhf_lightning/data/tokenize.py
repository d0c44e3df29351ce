"""Turning parsed examples into token ids: chat templates for conversations, EOS where a format needs it.

Prompt and completion are tokenized separately and concatenated, the way a policy sees them at generation time
(prompt tokens, then sampled tokens), so SFT, reward model and PPO all see the same token boundaries.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from rlhf_lightning.data.formats import Text, is_conversational
from rlhf_lightning.data.sources import DataFormatError


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Text, where: str) -> list[int]:
    """Token ids of a prompt: plain text with the tokenizer's special tokens (e.g. BOS), or a conversation
    rendered by the chat template with the generation prompt (the assistant turn opened)."""
    if is_conversational(prompt):
        if not prompt:
            return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return _apply_chat_template(tokenizer, prompt, where, add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def encode_completion(
    tokenizer: PreTrainedTokenizerBase, prompt: Text, completion: Text, prompt_ids: list[int], where: str
) -> list[int]:
    """Token ids of a completion, ending with EOS (appended when the text or template does not end with it).

    The EOS is what teaches a model to stop, and where a reward model reads its score.
    """
    if is_conversational(completion):
        prompt_messages = prompt if isinstance(prompt, list) else []
        full = _apply_chat_template(tokenizer, prompt_messages + completion, where, add_generation_prompt=False)
        if full[: len(prompt_ids)] != prompt_ids:
            raise DataFormatError(
                f"{where}: the chat template does not render the prompt as a prefix of the whole conversation, "
                "so the completion tokens cannot be separated; set `chat_template` to a prefix-consistent template"
            )
        completion_ids = full[len(prompt_ids) :]
    else:
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if not completion_ids or completion_ids[-1] != tokenizer.eos_token_id:
        completion_ids = [*completion_ids, tokenizer.eos_token_id]
    return completion_ids


def _apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list, where: str, add_generation_prompt: bool
) -> list[int]:
    if tokenizer.chat_template is None:
        raise DataFormatError(
            f"{where}: conversational data needs a chat template, and the tokenizer has none; "
            "set the base model's `chat_template`"
        )
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    )
