"""One frozen causal LM seen through named LoRA adapters: the heart of the project.

Every role is a view of the same base weights::

    policy    = adapter "policy"                 (trainable)
    reference = the base with adapters disabled  (frozen)
    critic    = adapter "critic" + value head    (trainable)
    reward    = adapter "reward" + score head    (frozen during PPO)

so the base weights are in memory once, whatever the number of roles. Sharded over ranks with FSDP2
(:mod:`rlhf_lightning.models.sharding`), each rank holds 1/world of them and every role still reads the same
shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from peft import PeftModel, get_peft_model
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from rlhf_lightning.models.adapter_files import AdapterFiles
from rlhf_lightning.models.fingerprint import weights_fingerprint
from rlhf_lightning.models.heads import ScalarHead
from rlhf_lightning.models.logits import LogitTransform, find_logit_transform
from rlhf_lightning.models.merging import adapter_of
from rlhf_lightning.models.sharding import decoder_layers, is_sharded
from rlhf_lightning.models.shared_prompt import prefix_groups, prefix_shared_hidden_states
from rlhf_lightning.models.spec import LoraSpec
from rlhf_lightning.ops.lora import fuse_lora_layers

REFERENCE = None  # the role name of the plain base model


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, so a left-padded prompt starts at position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class SharedBase(AdapterFiles, nn.Module):
    """A frozen causal LM with named LoRA adapters and scalar heads, each role a view of the same weights.

    ``with base.role("policy"): ...`` runs the block through the policy adapter alone; ``base.role(None)`` runs
    the plain base model (the reference). Heads live in ``heads`` under the name of their adapter.

    Args:
        model: the Hugging Face causal LM. Its weights are frozen here unless ``train_base`` is set.
        train_base: fine-tune the base weights too (full fine-tuning instead of adapters).
        fused_lora: run LoRA layers through :mod:`rlhf_lightning.ops.lora` (the same numbers, fewer
            passes over activations); off = peft's own forward.

    ``share_prompt`` (off here; the online modules set it): :meth:`hidden_states` given ``shared_until`` encodes
    rows' equal prefixes once (:mod:`rlhf_lightning.models.shared_prompt`). Adapters are loaded and saved, and
    merged exports written, by the methods of :class:`~rlhf_lightning.models.adapter_files.AdapterFiles`.
    """

    def __init__(self, model: PreTrainedModel, train_base: bool = False, fused_lora: bool = True) -> None:
        super().__init__()
        self.model: PreTrainedModel | PeftModel = model
        self.heads = nn.ModuleDict()
        self.train_base = train_base
        self.fused_lora = fused_lora
        self.share_prompt = False
        self.trainable_adapters: set[str] = set()
        # Of the weight files as they were when loaded: recorded beside the exported adapters, compared with the
        # record beside a trained adapter loaded onto this base.
        self.base_fingerprint = weights_fingerprint(model.config.name_or_path)
        self._requires_grad: list[tuple[nn.Parameter, bool]] = []
        # None: the model post-processes its logits in a way we cannot reproduce from the hidden states. A base
        # built on the meta device has no values to probe: `inspect_logits` runs once it has them.
        self.logit_transform: LogitTransform | None = None
        if not self.is_empty:
            self.inspect_logits()
        self._adapters_changed()

    # ---- structure -------------------------------------------------------------------------------------

    @property
    def hf_model(self) -> PreTrainedModel:
        """The underlying transformers model (with adapter layers injected, if any)."""
        return self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model

    @property
    def is_empty(self) -> bool:
        """Whether the base was built on the ``meta`` device (shapes only, no values: a rank of a sharded build
        that receives its values from rank 0)."""
        return self.hf_model.get_input_embeddings().weight.is_meta

    @property
    def is_sharded(self) -> bool:
        """Whether FSDP2 has sharded the base over ranks (see :mod:`rlhf_lightning.models.sharding`)."""
        return is_sharded(self)

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers: the units FSDP2 shards one by one."""
        return decoder_layers(self.hf_model)

    def after_sharding(self) -> None:
        """Once FSDP2 has replaced the parameters by their shards (on every rank, together): track the new
        parameter objects' trainability and probe the logits (a collective forward pass)."""
        self._update_requires_grad()
        self.inspect_logits()

    def inspect_logits(self) -> None:
        """Find how the model turns its LM head's output into logits (:func:`find_logit_transform`)."""
        self.logit_transform = find_logit_transform(self.hf_model, self.hidden_states, self.full_logits)

    @property
    def hidden_size(self) -> int:
        return self.hf_model.get_input_embeddings().embedding_dim

    @property
    def adapters(self) -> list[str]:
        """Names of the adapters on the base."""
        return list(self.model.peft_config) if isinstance(self.model, PeftModel) else []

    def add_adapter(self, name: str, lora: LoraSpec, trainable: bool = True) -> None:
        """Add a fresh LoRA adapter ``name``. Its output starts at zero: the role equals the base model."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} already exists")
        # GPT-2-style Conv1D layers store weights transposed; telling peft avoids a warning per adapter.
        config = lora.to_peft(fan_in_fan_out=any(isinstance(m, Conv1D) for m in self.hf_model.modules()))
        self._inject_adapter(name, config)
        if trainable:
            self.trainable_adapters.add(name)
        self._adapters_changed()

    def _inject_adapter(self, name: str, config) -> None:
        if isinstance(self.model, PeftModel):
            self.model.add_adapter(name, config)
        else:
            self.model = get_peft_model(self.model, config, adapter_name=name)

    def add_head(self, name: str) -> ScalarHead:
        """A fresh scalar head for role ``name`` (trainable)."""
        self.heads[name] = ScalarHead(self.hidden_size).to(self.hf_model.device)
        return self.heads[name]

    def copy_adapter(self, source: str, target: str) -> None:
        """Copy adapter ``source``'s weights and head into adapter ``target`` (same LoRA shape required)."""
        parameters = dict(self.model.named_parameters())
        copied = 0
        with torch.no_grad():
            for name, parameter in parameters.items():
                if adapter_of(name) == target:
                    source_name = name.replace(f".{target}.", f".{source}.")
                    if source_name not in parameters or parameters[source_name].shape != parameter.shape:
                        raise ValueError(
                            f"cannot copy adapter {source!r} into {target!r}: {source_name} is missing or has "
                            "another shape; give both the same LoRA rank and target modules"
                        )
                    parameter.copy_(parameters[source_name])
                    copied += 1
            if source in self.heads and target in self.heads:
                self.heads[target].load_state_dict(self.heads[source].state_dict())
        if copied == 0:
            raise ValueError(f"adapter {target!r} has no parameters to copy into")

    def adapter_parameters(self, adapter: str) -> list[nn.Parameter]:
        """The parameters of LoRA adapter ``adapter``, and of its head if it has one."""
        parameters = [p for name, p in self.model.named_parameters() if adapter_of(name) == adapter]
        if adapter in self.heads:
            parameters += list(self.heads[adapter].parameters())
        return parameters

    def base_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The base model's own parameters (not adapters, not heads)."""
        for name, parameter in self.model.named_parameters():
            if adapter_of(name) is None:
                yield name, parameter

    # ---- roles ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def role(self, adapter: str | None) -> Iterator[None]:
        """Run the block with only ``adapter`` active; ``None`` runs the plain base model (the reference)."""
        if not isinstance(self.model, PeftModel):
            if adapter is not None:
                raise ValueError(f"no adapter {adapter!r}: the base has no adapters")
            yield
            return
        if adapter is None:
            # peft freezes adapters when disabling them and re-enables only the active one afterwards.
            try:
                with self.model.disable_adapter():
                    self._apply_requires_grad()
                    yield
            finally:
                self._apply_requires_grad()
            return
        if adapter not in self.model.peft_config:
            raise ValueError(f"no adapter {adapter!r}; the base has {self.adapters}")
        previous = self.model.active_adapter
        self._activate(adapter)
        try:
            yield
        finally:
            self._activate(previous)

    def _activate(self, adapter: str) -> None:
        if self.model.active_adapter != adapter:
            self.model.set_adapter(adapter)
            # peft makes the active adapter trainable and the others frozen; trainability is ours to decide.
            self._apply_requires_grad()

    def _adapters_changed(self) -> None:
        """After peft has injected or loaded adapter layers: fuse the new layers, then set trainability."""
        if self.fused_lora:
            fuse_lora_layers(self.model)
        self._update_requires_grad()

    def _update_requires_grad(self) -> None:
        flags = []
        for name, parameter in self.model.named_parameters():
            adapter = adapter_of(name)
            flags.append((parameter, self.train_base if adapter is None else adapter in self.trainable_adapters))
        self._requires_grad = flags
        self._apply_requires_grad()

    def _apply_requires_grad(self) -> None:
        for parameter, flag in self._requires_grad:
            parameter.requires_grad_(flag)

    # ---- forward passes ---------------------------------------------------------------------------------

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor, shared_until: int | None = None) -> Tensor:
        """Last hidden states ``[B, T, H]`` of the active role, through the decoder only (no LM head).

        Skipping the LM head lets callers apply it to the positions they need, which for a large vocabulary is
        most of the memory of a forward pass. ``shared_until``: with :attr:`share_prompt`, rows whose first
        ``shared_until`` columns are equal (a group's prompt) encode them once, the same numbers up to rounding
        (:mod:`rlhf_lightning.models.shared_prompt`).
        """
        position_ids = position_ids_from_mask(attention_mask)
        decoder = self.hf_model.get_decoder()
        if (self.share_prompt and shared_until is not None and 0 < shared_until < input_ids.shape[1]
                and not self._checkpointing(decoder)):
            groups = prefix_groups(input_ids, attention_mask, shared_until)
            # Sharded, every rank makes the same two calls (each layer's all-gather is a collective), shared or not.
            if groups is not None or self.is_sharded:
                return prefix_shared_hidden_states(decoder, input_ids, attention_mask, position_ids, shared_until,
                                                   groups)
        output = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False)
        return output.last_hidden_state

    def _checkpointing(self, decoder: nn.Module) -> bool:
        """Whether ``decoder`` recomputes its layers in the backward pass now: transformers then drops the cache
        (and a recomputed layer would write it twice), so rows keep one whole pass each."""
        return decoder.training and any(getattr(module, "gradient_checkpointing", False) for module in decoder.modules())

    @property
    def lm_head(self) -> nn.Module:
        """The output projection; :meth:`logits` adds the model's own post-processing (e.g. soft-capping)."""
        return self.hf_model.get_output_embeddings()

    def logits(self, hidden: Tensor) -> Tensor:
        """The model's logits at ``hidden`` (from :meth:`hidden_states`): the LM head, then whatever the model
        does to its output (Gemma-2's soft cap, Cohere's scale); requires a known :attr:`logit_transform`."""
        if self.logit_transform is None:
            raise RuntimeError(f"{type(self.hf_model).__name__}'s logits cannot be computed from hidden states; "
                               "use next_token_logits")
        return self.logit_transform(self.lm_head(hidden))

    def next_token_logits(self, input_ids: Tensor, attention_mask: Tensor, start: int = 1) -> Tensor:
        """Logits ``[B, T - start, V]`` of the active role predicting tokens ``start .. T-1``, equal to the
        model's own forward pass: from the hidden states when the logit post-processing is known, else through
        the full forward pass (computing the LM head on the needed positions only)."""
        if self.logit_transform is not None:
            hidden = self.hidden_states(input_ids, attention_mask)
            return self.logits(hidden[:, start - 1 : -1].contiguous())
        return self.full_logits(input_ids, attention_mask, logits_to_keep=input_ids.shape[1] - start + 1)[:, :-1]

    def full_logits(self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int = 0) -> Tensor:
        """The logits of the model's own forward pass (LM head and post-processing), on the last
        ``logits_to_keep`` positions (0 = all)."""
        return self.hf_model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                             logits_to_keep=logits_to_keep).logits

    def score(self, role: str, input_ids: Tensor, attention_mask: Tensor, last_index: Tensor,
              shared_until: int | None = None) -> Tensor:
        """The scalar head of ``role`` applied at token ``last_index[b]`` of each row: ``[B]`` (``shared_until``: see
        :meth:`hidden_states`)."""
        with self.role(role):
            hidden = self.hidden_states(input_ids, attention_mask, shared_until)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.heads[role](hidden[rows, last_index])
