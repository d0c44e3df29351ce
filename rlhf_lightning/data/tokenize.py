"""Turning parsed examples into token ids: chat templates for conversations, EOS where a format needs it.

Prompt and completion are tokenized separately and concatenated, the way a policy sees them at generation time
(prompt tokens, then sampled tokens), so SFT, reward model and PPO all see the same token boundaries.

A completion ends where generation stops: plain text with EOS; a conversation with the token its chat template
closes an assistant turn with (:func:`turn_end_token_id`: ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``),
without what the template writes after it (ChatML's newline) and without a second EOS.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from rlhf_lightning.data.collate import IGNORE_INDEX, EncodedSteps
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


_PROBE_CONTENT = "rlhf-lightning-probe"


def turn_end_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template writes right after an assistant message, or None (no template, or
    a template that closes turns with plain text or nothing).

    Found by rendering a probe conversation, so it follows whatever template the tokenizer carries.
    """
    template = tokenizer.chat_template
    if template is None:
        return None
    cached = getattr(tokenizer, "_rlhf_turn_end", None)
    if cached is not None and cached[0] == template:
        return cached[1]
    token = _probe_turn_end(tokenizer)
    tokenizer._rlhf_turn_end = (template, token)
    return token


def _probe_turn_end(tokenizer: PreTrainedTokenizerBase) -> int | None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_CONTENT}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that refuses this shape (e.g. requires a system message) tells us nothing
        return None
    if _PROBE_CONTENT not in text:
        return None
    after = tokenizer(text.rsplit(_PROBE_CONTENT, 1)[1], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {
        token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    return after[0] if after and after[0] in special else None


def completion_end_id(tokenizer: PreTrainedTokenizerBase, conversational: bool) -> int:
    """The token a completion ends with (and where a reward model reads its score): the chat template's
    turn-end token in conversations when it has one, else EOS."""
    turn_end = turn_end_token_id(tokenizer) if conversational else None
    return tokenizer.eos_token_id if turn_end is None else turn_end


def encode_completion(
    tokenizer: PreTrainedTokenizerBase, prompt: Text, completion: Text, prompt_ids: list[int], where: str
) -> list[int]:
    """Token ids of a completion, ending with :func:`completion_end_id` (appended when missing; in
    conversations whatever the template writes after its last turn-end token is dropped).

    That token is what teaches a model to stop, and where a reward model reads its score.
    """
    end = completion_end_id(tokenizer, is_conversational(completion))
    if is_conversational(completion):
        prompt_messages = prompt if isinstance(prompt, list) else []
        full = _apply_chat_template(tokenizer, prompt_messages + completion, where, add_generation_prompt=False)
        if full[: len(prompt_ids)] != prompt_ids:
            raise DataFormatError(
                f"{where}: the chat template does not render the prompt as a prefix of the whole conversation, "
                "so the completion tokens cannot be separated; set `chat_template` to a prefix-consistent template"
            )
        completion_ids = full[len(prompt_ids) :]
        if end in completion_ids:
            # Generation stops at the turn-end token: what follows it (ChatML's newline) is never sampled.
            completion_ids = completion_ids[: len(completion_ids) - completion_ids[::-1].index(end)]
    else:
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if not completion_ids or completion_ids[-1] not in (end, tokenizer.eos_token_id):
        completion_ids = [*completion_ids, end]
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


def separator_token_id(tokenizer: PreTrainedTokenizerBase, separator: str, what: str) -> int:
    """The one token id of a process reward model's step ``separator`` (``what`` names the setting in the
    message): a step's end must be one token, to be found in sampled responses and read there."""
    ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        spelled = "the unknown token" if ids and ids[0] == tokenizer.unk_token_id else f"{len(ids)} tokens {ids}"
        raise ValueError(f"{what}={separator!r} is {spelled} under tokenizer "
                         f"{getattr(tokenizer, 'name_or_path', '?')!r}: a step's end must be one token of its "
                         "vocabulary (e.g. '\\n' for most tokenizers, ',' for the arithmetic task)")
    return ids[0]


def encode_steps(tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], steps: list[str], labels: list[bool],
                 separator_id: int, where: str, last_step_only: bool = False) -> EncodedSteps:
    """A prompt's ids followed by each step's tokens and the separator token, the step's label (1/0) at its
    separator and ``IGNORE_INDEX`` elsewhere, as TRL's PRMTrainer encoded them; ``last_step_only`` keeps the last
    step's label only. A step holding the separator token is an error naming ``where``."""
    input_ids, targets = list(prompt_ids), [IGNORE_INDEX] * len(prompt_ids)
    for index, (step, label) in enumerate(zip(steps, labels, strict=True), start=1):
        step_ids = tokenizer(step, add_special_tokens=False)["input_ids"]
        if separator_id in step_ids:
            raise DataFormatError(f"{where}: column 'completions' step {index}: holds the separator token "
                                  f"{tokenizer.convert_ids_to_tokens(separator_id)!r}, which marks where a step ends")
        keep = not last_step_only or index == len(steps)
        input_ids += [*step_ids, separator_id]
        targets += [IGNORE_INDEX] * len(step_ids) + [int(label) if keep else IGNORE_INDEX]
    return EncodedSteps(input_ids, targets)
