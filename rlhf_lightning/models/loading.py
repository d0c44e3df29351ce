"""Loading tokenizers and causal LMs: from the hub, from a local folder, or fresh from a config.

Before transformers is asked, a path that names a local folder must exist (else transformers reports it as a bad
hub id, or tries the network), and a folder must hold a tokenizer when the tokenizer is read from it. After
loading, the tokenizer must fit the model (:func:`check_tokenizer_fits`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.ops.activations import fuse_tanh_gelu
from rlhf_lightning.tasks import TOKENIZERS, build_task_tokenizer

log = logging.getLogger(__name__)

PAD_TOKEN = "<|pad|>"
# Files of which a saved tokenizer has at least one (fast tokenizers, BPE, SentencePiece, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model",
                   "vocab.txt", "sentencepiece.bpe.model", "tekken.json")
# A tokenizer smaller than this share of the model's embeddings belongs to another model (embedding tables are
# padded above the tokenizer by at most a few hundred rows, e.g. Qwen2.5's 151665 tokens for 151936 rows).
MIN_VOCABULARY_SHARE = 0.5
ROUND_TRIP_TEXT = "Hello, world. 1 2 3"


def looks_local(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is meant as a local folder rather than a hub id: it starts with ``.``, ``/`` or
    ``~``, contains ``outputs/`` (where the stages write), or its first component exists here."""
    if name_or_path.startswith((".", "/", "~")) or "outputs/" in name_or_path or "\\" in name_or_path:
        return True
    first = Path(name_or_path).parts[0] if Path(name_or_path).parts else ""
    return len(Path(name_or_path).parts) > 1 and Path(first).exists()


def check_local_folder(name_or_path: str, role: str = "model") -> None:
    """A clear error for a local-looking ``name_or_path`` that is not a folder, before transformers mistakes it
    for a hub repository id. ``role``: ``model`` or ``tokenizer``."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() or not looks_local(name_or_path):
        return
    if path.exists():
        raise NotADirectoryError(f"{role} folder {name_or_path} is a file, not a folder saved by save_pretrained")
    hint = " (run the SFT stage first?)" if "outputs/" in name_or_path else ""
    raise FileNotFoundError(f"{role} folder {name_or_path} does not exist{hint}")


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached from here (a connection to its host within ``timeout``), or None
    when it can, when ``HF_HUB_OFFLINE`` is set (nothing will be fetched), or behind a proxy (not probed)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or any(
            os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    return connection_refused(endpoint.hostname, endpoint.port or 443, timeout)


@functools.cache
def connection_refused(host: str, port: int, timeout: float) -> str | None:
    """Why ``host:port`` takes no connection within ``timeout``, or None. Probed once per process: the tokenizer,
    the model and the positions check of one fit ask the same question."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        return f"{host}: {error.strerror or type(error).__name__}"
    return None


def check_hub_name(name: str, role: str = "model") -> None:
    """Before transformers tries a hub id: when the hub cannot be reached, one line at once instead of about a
    minute of huggingface_hub's retries (a name not in the local cache), or a warning saying how to skip them (a
    cached one)."""
    if looks_local(name) or Path(name).expanduser().exists():
        return
    reason = hub_unreachable()
    if reason is None:
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        warnings.warn(f"{role} {name!r}: the Hugging Face hub cannot be reached ({reason}); it is in the local "
                      "cache, loaded from there after huggingface_hub's retries: set HF_HUB_OFFLINE=1 to skip them",
                      UserWarning, stacklevel=2)
        return
    raise ValueError(f"{role} {name!r} is not a local folder, not in the Hugging Face cache, and the hub cannot be "
                     f"reached from this machine ({reason}): give the folder it is saved in, or download it where "
                     "the hub is reachable (huggingface-cli download) and set HF_HUB_OFFLINE=1 here")


@contextlib.contextmanager
def hub_errors(name: str, role: str = "model") -> Iterator[None]:
    """Turn transformers' ``OSError`` for a name that is neither a local folder nor reachable on the hub (a typo,
    or no network) into one line naming it."""
    try:
        yield
    except OSError as error:
        if Path(name).expanduser().exists():
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{role} {name!r} is not a local folder and could not be fetched from the Hugging Face "
                         f"hub ({first}): check the name, or give the folder it is saved in") from error


def load_tokenizer(spec: BaseModelSpec) -> PreTrainedTokenizerBase:
    """The tokenizer of ``spec``, with a dedicated pad token and left padding (what generation needs)."""
    source = spec.tokenizer or spec.name_or_path
    if source is None:
        raise ValueError(
            "base model: set `tokenizer` (a hub id, a folder or 'synthetic') when `name_or_path` is null"
        )
    if source in TOKENIZERS:
        tokenizer = build_task_tokenizer(source)
    else:
        check_local_folder(source, "tokenizer" if spec.tokenizer else "model")
        folder = Path(source).expanduser()
        if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"{folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}...): set base.tokenizer "
                "to the model's tokenizer (a hub id or folder), or save it there with tokenizer.save_pretrained"
            )
        check_hub_name(source, "tokenizer" if spec.tokenizer else "model")
        with hub_errors(source, "tokenizer" if spec.tokenizer else "model"):
            tokenizer = AutoTokenizer.from_pretrained(
                source, revision=spec.revision, trust_remote_code=spec.trust_remote_code
            )
    if spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {source!r} has no EOS token; responses could never end")
    check_round_trip(tokenizer, source)
    ensure_pad_token(tokenizer)
    tokenizer.padding_side = "left"
    return tokenizer


def check_round_trip(tokenizer: PreTrainedTokenizerBase, source: str) -> None:
    """A test text must encode to tokens that decode back to text: a tokenizer without a vocabulary (e.g. read
    from a folder that holds only a model) encodes everything to nothing."""
    ids = tokenizer.encode(ROUND_TRIP_TEXT, add_special_tokens=False)
    if not ids or not tokenizer.decode(ids).strip():
        raise ValueError(f"tokenizer {source!r} ({len(tokenizer)} tokens) encodes {ROUND_TRIP_TEXT!r} to "
                         f"{ids} and back to nothing: it has no usable vocabulary")


def check_tokenizer_fits(tokenizer: PreTrainedTokenizerBase, rows: int, spec: BaseModelSpec) -> None:
    """The tokenizer belongs to the model: its ids index the model's embeddings.

    The rule: every token id is below the number of embedding rows, except the pad token :func:`ensure_pad_token`
    appended (the embeddings grow by that one row); and the tokenizer covers at least half of the rows (tables
    are padded above the tokenizer by at most a few hundred rows; a tokenizer much smaller is another model's).
    ``rows``: the model's embedding rows (its config's ``vocab_size`` before loading, the table after).
    """
    size = len(tokenizer)
    appended_pad = tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id == size - 1
    if size - int(appended_pad) > rows:
        reason = f"its ids reach {size - 1 - int(appended_pad)}, beyond the model's {rows} embedding rows"
    elif size < MIN_VOCABULARY_SHARE * rows:
        reason = f"it covers fewer than half of the model's {rows} embedding rows"
    else:
        return
    source = spec.tokenizer or spec.name_or_path
    raise ValueError(
        f"tokenizer {source!r} ({size} tokens) does not fit model {spec.name_or_path!r}: {reason}; set "
        "base.tokenizer to the model's own tokenizer, or null to read it from the model folder"
    )


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Give ``tokenizer`` a pad token of its own if it has none, or if it pads with EOS.

    Padding with EOS hides a real signal: code that masks labels by pad id then also masks the EOS that teaches
    a model to stop. Returns whether a token was added (the model's embeddings must then grow).
    """
    if tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return False
    log.info("tokenizer has no dedicated pad token; adding %s", PAD_TOKEN)
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    return True


def load_causal_lm(spec: BaseModelSpec, tokenizer: PreTrainedTokenizerBase, empty: bool = False) -> PreTrainedModel:
    """The causal LM of ``spec``: ``from_pretrained`` when a name or path is set, else a fresh model.

    The model's embeddings are grown to fit the tokenizer (e.g. an added pad token), its config learns the pad
    and EOS ids, and dropout is switched off (see :func:`disable_dropout`). ``empty`` builds the same modules on
    the ``meta`` device without reading a weight (the ranks of a sharded build that receive rank 0's values).
    """
    dtype = spec.dtype if spec.dtype == "auto" else getattr(torch, spec.dtype)
    if empty:
        model = empty_causal_lm(spec, tokenizer, dtype)
    elif spec.name_or_path is not None:
        check_local_folder(spec.name_or_path)
        if spec.tokenizer:  # the tokenizer came from elsewhere: the model's name was not probed
            check_hub_name(spec.name_or_path)
        rows = configured_vocab_size(spec)
        if rows is not None:  # before the weights are read: a mismatch fails in a second
            check_tokenizer_fits(tokenizer, rows, spec)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                spec.name_or_path,
                revision=spec.revision,
                trust_remote_code=spec.trust_remote_code,
                dtype=dtype,
                attn_implementation=spec.attn_implementation,
            )
        except SafetensorError as error:  # a cut-short copy or a file that is not safetensors: say which
            raise ValueError(f"model {spec.name_or_path}: its weights cannot be read ({error}); copy or save the "
                             "model again") from error
        check_tokenizer_fits(tokenizer, model.get_input_embeddings().num_embeddings, spec)
    else:
        model = AutoModelForCausalLM.from_config(
            fresh_config(spec, tokenizer),
            dtype=None if dtype == "auto" else dtype,
            attn_implementation=spec.attn_implementation,
            trust_remote_code=spec.trust_remote_code,
        )
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        # On the meta device there are no rows to average for the new ones; rank 0's values replace them anyway.
        model.resize_token_embeddings(len(tokenizer), mean_resizing=not empty)
    for config in (model.config, model.generation_config):
        config.pad_token_id = tokenizer.pad_token_id
        config.eos_token_id = tokenizer.eos_token_id
    disable_dropout(model)
    if spec.fused_activations:
        fuse_tanh_gelu(model)
    if spec.gradient_checkpointing:
        # Non-reentrant checkpointing works with a frozen base whose inputs do not require grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def empty_causal_lm(spec: BaseModelSpec, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype | str) -> PreTrainedModel:
    """``spec``'s model on the ``meta`` device, from its config alone, in the dtype ``from_pretrained`` would
    give it."""
    if spec.name_or_path is not None:
        check_local_folder(spec.name_or_path)
        config = AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision,
                                            trust_remote_code=spec.trust_remote_code)
        rows = configured_vocab_size(spec)
        if rows is not None:
            check_tokenizer_fits(tokenizer, rows, spec)
    else:
        config = fresh_config(spec, tokenizer)
    if dtype == "auto":  # the checkpoint's own dtype, as from_pretrained(dtype="auto") reads it
        dtype = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=spec.attn_implementation,
                                                trust_remote_code=spec.trust_remote_code)


def position_limit(spec: BaseModelSpec, tokenizer: PreTrainedTokenizerBase) -> tuple[int | None, str, bool]:
    """``(limit, field, learned)``: how many positions ``spec``'s model takes (its config's ``n_positions`` or
    ``max_position_embeddings``; None when it says neither), the config field it came from, and whether its
    positions are learned embeddings (GPT-2, OPT: a longer sequence indexes past the table and fails) rather
    than rotary or ALiBi (a longer sequence runs, beyond what the model was trained on). Reads the config only."""
    if spec.name_or_path is not None:
        check_local_folder(spec.name_or_path)
        check_hub_name(spec.name_or_path)
        with hub_errors(spec.name_or_path):
            config = AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision,
                                                trust_remote_code=spec.trust_remote_code)
    else:
        config = fresh_config(spec, tokenizer)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field in ("n_positions", "max_position_embeddings"):
        limit = getattr(config, field, None)
        if isinstance(limit, int) and limit > 0:
            rotary = any(getattr(config, name, None) is not None for name in
                         ("rope_theta", "rope_scaling", "rope_parameters", "rotary_pct", "rotary_dim",
                          "partial_rotary_factor", "alibi"))
            return limit, field, not rotary
    return None, "", False


def check_positions(spec: BaseModelSpec, tokenizer: PreTrainedTokenizerBase, tokens: int, what: str,
                    fix: str) -> None:
    """Refuse sequences of ``tokens`` positions beyond the limit of ``spec``'s model before any training, with one
    line (``what`` they are, ``fix``: the settings that shorten them); warn instead for rotary positions, which run
    past the trained length."""
    limit, field, learned = position_limit(spec, tokenizer)
    if limit is None or tokens <= limit:
        return
    message = (f"{what} reach{'es' if what.endswith('prompt') else ''} {tokens} positions, beyond the "
               f"{limit} of model {spec.name_or_path or 'base'} ({field})")
    if learned:
        raise ValueError(f"{message}, whose learned position embeddings stop there; {fix}")
    log.warning("%s: its rotary positions run past the length it was trained on", message)


def configured_vocab_size(spec: BaseModelSpec) -> int | None:
    """The vocabulary size in the config of ``spec``'s pretrained model (its text model's, for multimodal ones),
    or None when the config does not say."""
    with hub_errors(spec.name_or_path):
        config = AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision,
                                            trust_remote_code=spec.trust_remote_code)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text_config, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def fresh_config(spec: BaseModelSpec, tokenizer: PreTrainedTokenizerBase):
    """A transformers config for a randomly initialised model from ``spec.architecture``."""
    if not spec.architecture or "model_type" not in spec.architecture:
        raise ValueError(
            "base model: with `name_or_path` null, `architecture` must give at least `model_type` "
            "(e.g. {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 4})"
        )
    fields = dict(spec.architecture)
    model_type = fields.pop("model_type")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    fields.setdefault("vocab_size", len(tokenizer))
    return AutoConfig.for_model(
        model_type,
        bos_token_id=bos,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )


_DROPOUT_ATTRIBUTES = ("attention_dropout", "dropout", "dropout_p", "attn_dropout_p")


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability in ``model`` to 0.

    RL needs the log-probabilities of the rollout and of the update to agree (ratio = 1 before any step), and a
    reward model's scores to be deterministic. Covers ``nn.Dropout`` modules and the float attributes that
    attention implementations read directly.
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name in _DROPOUT_ATTRIBUTES:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in config.to_dict().items():
            if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
                setattr(config, key, 0.0)
