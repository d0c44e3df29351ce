"""The word-level chat tokenizer the tasks with a chat template build locally (``calculator``, ``reasoning_gym``):
its words and characters one token each, its markers special tokens, left padding, and decoding that joins the
tokens as they were written."""

from __future__ import annotations

import re
from collections.abc import Sequence


def word_level_chat_tokenizer(special_tokens: Sequence[str], words: Sequence[str], characters: Sequence[str],
                              chat_template: str, model_max_length: int, other: str = "."):
    """A fast tokenizer whose vocabulary is ``special_tokens`` (pad, EOS and unknown first, then the template's
    markers), ``words`` (matched whole, longest first) and ``characters``; any other text is cut by the regex
    ``other`` (``.``: a character but a newline) and read as unknown."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pad, eos, unk = special_tokens[:3]
    vocabulary = list(dict.fromkeys([*special_tokens, *words, *characters]))
    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocabulary)}, unk_token=unk))
    pieces = "|".join(re.escape(word) for word in sorted(words, key=len, reverse=True))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(f"{pieces}|{other}"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(special_tokens))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, eos_token=eos, unk_token=unk,
                                        additional_special_tokens=list(special_tokens[3:]), padding_side="left",
                                        model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = chat_template
    return tokenizer
