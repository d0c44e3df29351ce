"""Tokenizer and model loading, and the shared base with its adapters and heads."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.activations import GELUTanh, NewGELUActivation

from rlhf_lightning.models.heads import ScalarHead
from rlhf_lightning.models.loading import (
    PAD_TOKEN,
    disable_dropout,
    load_causal_lm,
    load_tokenizer,
)
from rlhf_lightning.models.shared_base import SharedBase, adapter_of, position_ids_from_mask
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.ops.activations import fuse_tanh_gelu
from tests.helpers.models import TINY_ARCHITECTURE, tiny_spec


def _save_tokenizer_without_pad(directory, pad_with_eos=False):
    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>",
                                        pad_token="</s>" if pad_with_eos else None)
    tokenizer.save_pretrained(directory)


@pytest.mark.parametrize("pad_with_eos", [False, True])
def test_tokenizer_gets_a_dedicated_pad_token_and_the_model_grows(tmp_path, pad_with_eos):
    _save_tokenizer_without_pad(tmp_path, pad_with_eos)
    spec = BaseModelSpec(tokenizer=str(tmp_path), architecture=dict(TINY_ARCHITECTURE))
    tokenizer = load_tokenizer(spec)
    assert tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.pad_token_id not in (tokenizer.eos_token_id, None)
    assert tokenizer.padding_side == "left"
    model = load_causal_lm(spec, tokenizer)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer) == 5
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_missing_tokenizer_and_architecture_give_clear_errors():
    with pytest.raises(ValueError, match="set `tokenizer`"):
        load_tokenizer(BaseModelSpec())
    spec = BaseModelSpec(tokenizer="synthetic")
    with pytest.raises(ValueError, match="model_type"):
        load_causal_lm(spec, load_tokenizer(spec))


def test_from_pretrained_folder_loads_the_saved_weights(tiny_model_dir):
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(spec)
    model = load_causal_lm(spec, tokenizer)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_fused_gelu_replaces_the_python_formula_with_the_same_function(tiny_model_dir):
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(spec)
    fused = load_causal_lm(spec, tokenizer)
    python = load_causal_lm(BaseModelSpec(name_or_path=str(tiny_model_dir), fused_activations=False), tokenizer)
    assert fused.config.activation_function == "gelu_new"  # the saved config is left as it was
    assert [type(block.mlp.act) for block in fused.transformer.h] == [GELUTanh] * TINY_ARCHITECTURE["n_layer"]
    assert all(type(block.mlp.act) is NewGELUActivation for block in python.transformer.h)
    ids = torch.randint(7, 60, (2, 10))
    torch.testing.assert_close(fused(ids).logits, python(ids).logits, rtol=1e-5, atol=1e-5)
    assert fuse_tanh_gelu(python) == TINY_ARCHITECTURE["n_layer"] and fuse_tanh_gelu(python) == 0


def test_dropout_is_disabled_everywhere():
    spec = tiny_spec()
    model = load_causal_lm(spec, load_tokenizer(spec))
    assert model.config.attn_pdrop == model.config.resid_pdrop == model.config.embd_pdrop == 0.0
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    model.train()
    ids = torch.randint(7, 60, (2, 10))
    assert torch.equal(model(ids).logits, model(ids).logits)
    # disable_dropout also covers the float attributes attention modules read directly
    module = torch.nn.Module()
    module.attention_dropout = 0.1
    disable_dropout(module)
    assert module.attention_dropout == 0.0


@pytest.fixture
def shared(tiny_model_dir):
    torch.manual_seed(1)
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(spec)
    base = SharedBase(load_causal_lm(spec, tokenizer))
    base.add_adapter("policy", LoraSpec(r=4, alpha=8))
    base.add_adapter("critic", LoraSpec(r=4, alpha=8))
    base.add_adapter("reward", LoraSpec(r=4, alpha=8), trainable=False)
    base.add_head("critic")
    return base


def _inputs():
    ids = torch.randint(7, 60, (3, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask


def _perturb(base, adapter):
    with torch.no_grad():
        for name, parameter in base.model.named_parameters():
            if adapter_of(name) == adapter and "lora_B" in name:
                parameter.normal_(0, 0.5)


def test_fresh_adapter_equals_the_base_and_reference_is_the_base(shared):
    ids, mask = _inputs()
    with shared.role(None):
        reference = shared.hidden_states(ids, mask)
    with shared.role("policy"):
        policy = shared.hidden_states(ids, mask)
    assert torch.equal(policy, reference)  # LoRA B starts at zero
    _perturb(shared, "policy")
    with shared.role("policy"):
        moved = shared.hidden_states(ids, mask)
    with shared.role(None):
        still_reference = shared.hidden_states(ids, mask)
    with shared.role("critic"):
        critic = shared.hidden_states(ids, mask)
    assert not torch.allclose(moved, reference)
    assert torch.equal(still_reference, reference)
    assert torch.equal(critic, reference)  # only the policy adapter moved


def test_switching_roles_keeps_trainability_ours(shared):
    def trainable():
        return {adapter_of(n) for n, p in shared.model.named_parameters() if p.requires_grad}

    assert trainable() == {"policy", "critic"}
    for role in ("reward", "critic", None, "policy"):
        with shared.role(role):
            assert trainable() == {"policy", "critic"}
    assert all(not p.requires_grad for _, p in shared.base_parameters())
    with pytest.raises(ValueError, match="no adapter 'nope'"), shared.role("nope"):
        pass


def test_gradients_of_a_role_reach_only_its_adapter(shared):
    ids, mask = _inputs()
    _perturb(shared, "policy")  # B != 0 so that A gets a gradient too
    with shared.role("policy"):
        shared.lm_head(shared.hidden_states(ids, mask)).sum().backward()
    with_grad = {adapter_of(n) for n, p in shared.model.named_parameters() if p.grad is not None}
    assert with_grad == {"policy"}


def test_left_padding_with_position_ids_matches_the_unpadded_sequence(shared):
    ids, mask = _inputs()
    assert position_ids_from_mask(mask)[0].tolist() == [0, 0, 0, 0, 1, 2, 3, 4]
    with shared.role(None):
        padded = shared.hidden_states(ids, mask)[0, 3:]
        alone = shared.hidden_states(ids[:1, 3:], mask[:1, 3:])[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


def test_adapter_and_head_save_and_load_give_identical_scores(shared, tiny_model_dir, tmp_path):
    _perturb(shared, "critic")
    ids, mask = _inputs()
    last = mask.sum(-1) - 1 + (mask == 0).sum(-1)  # last column for left padding
    before = shared.score("critic", ids, mask, last)
    out = shared.save_adapter("critic", tmp_path)
    assert (out / "adapter_config.json").exists() and ScalarHead.exists(out)
    # peft alone can read the adapter
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    assert isinstance(plain, PeftModel)
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    fresh = SharedBase(load_causal_lm(spec, load_tokenizer(spec)))
    fresh.load_adapter(out, "critic")
    assert torch.equal(fresh.score("critic", ids, mask, last), before)


def test_merged_model_equals_the_adapter_and_leaves_the_base_untouched(shared, tmp_path):
    _perturb(shared, "policy")
    base_before = {n: p.clone() for n, p in shared.base_parameters()}
    ids, mask = _inputs()
    with shared.role("policy"):
        expected = shared.lm_head(shared.hidden_states(ids, mask))
    shared.save_merged("policy", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    logits = merged(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    for name, parameter in shared.base_parameters():
        assert torch.equal(parameter, base_before[name]), name


def test_copy_adapter_copies_weights_and_head(shared):
    shared.add_head("reward")
    _perturb(shared, "reward")
    torch.nn.init.normal_(shared.heads["reward"].linear.weight)
    shared.copy_adapter("reward", "critic")
    ids, mask = _inputs()
    last = torch.full((3,), 7)
    assert torch.equal(shared.score("critic", ids, mask, last), shared.score("reward", ids, mask, last))


def test_exported_files_are_readable_as_the_umask_allows(shared, tmp_path):
    """safetensors writes 0o600; a colleague on a shared cluster must be able to read an export (0o644 under the
    usual umask 022, 0o640 under 027)."""
    import os

    for mask, mode in ((0o022, 0o644), (0o027, 0o640)):
        previous = os.umask(mask)
        try:
            adapter = shared.save_adapter("critic", tmp_path / f"adapter-{mask:o}")
            merged = shared.save_merged("critic", tmp_path / f"merged-{mask:o}")
        finally:
            os.umask(previous)
        files = [path for folder in (adapter, merged) for path in folder.rglob("*") if path.is_file()]
        assert {path.suffix for path in files} >= {".safetensors", ".json"}
        assert {path.name: path.stat().st_mode & 0o777 for path in files} == {path.name: mode for path in files}
