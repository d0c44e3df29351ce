"""SFT: loss on completion tokens only, LoRA or full fine-tuning, export of a plain model."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rlhf_lightning.data.collate import EncodedSFT, collate_sft
from rlhf_lightning.data.modules import SFTDataModule
from rlhf_lightning.models.shared_base import adapter_of, position_ids_from_mask
from rlhf_lightning.models.spec import LoraSpec
from rlhf_lightning.stages.sft import SFT
from tests.helpers.models import built, tiny_spec


def _batch(tokenizer):
    examples = [EncodedSFT([7, 12, 61, 56, 1], prompt_length=2), EncodedSFT([8, 13, 61, 40, 62, 1], 3)]
    return collate_sft(examples, tokenizer.pad_token_id)


def test_loss_is_cross_entropy_over_completion_tokens_only():
    torch.manual_seed(0)
    module = built(SFT(base=tiny_spec()))
    batch = _batch(module.tokenizer)
    loss, tokens = module.loss(batch)
    logits = module.model.hf_model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
        position_ids=position_ids_from_mask(batch["attention_mask"]),
    ).logits
    log_probs = F.log_softmax(logits.float(), -1)
    # positions predicting completion tokens: row 0 predicts ids[2:5] from 1..3, row 1 ids[3:6] from 2..4
    picked = [log_probs[0, t - 1, batch["input_ids"][0, t]] for t in range(2, 5)]
    picked += [log_probs[1, t - 1, batch["input_ids"][1, t]] for t in range(3, 6)]
    expected = -torch.stack(picked).mean()
    torch.testing.assert_close(loss, expected)
    assert tokens.item() == 6


def test_changing_a_prompt_token_target_does_not_change_the_loss():
    torch.manual_seed(0)
    module = built(SFT(base=tiny_spec()))
    batch = _batch(module.tokenizer)
    changed = {key: value.clone() for key, value in batch.items()}
    changed["labels"][0, 1] = 30  # pretend a prompt token were a target: it would change the loss
    assert not torch.allclose(module.loss(batch)[0], module.loss(changed)[0])
    assert batch["labels"][0, :2].tolist() == [-100, -100]  # which collate_sft guarantees


def test_lora_sft_trains_only_the_adapter_and_exports_a_merged_model(tmp_path):
    torch.manual_seed(0)
    module = built(SFT(base=tiny_spec(), lora=LoraSpec(r=4, alpha=8), optimizer={"lr": 1e-2}, export_dir=str(tmp_path / "model")))
    base_before = {n: p.clone() for n, p in module.model.base_parameters()}
    data = SFTDataModule(dataset="synthetic", synthetic_rows=64, batch_size=8, val_fraction=0.25, max_length=64)
    trainer = L.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    assert {adapter_of(n) for n, p in module.model.model.named_parameters() if p.requires_grad} == {"sft"}
    for name, parameter in module.model.base_parameters():
        assert torch.equal(parameter, base_before[name]), name
    batch = _batch(module.tokenizer)
    with module.model.role("sft"):
        expected = module.model.lm_head(module.model.hidden_states(batch["input_ids"], batch["attention_mask"]))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    logits = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=position_ids_from_mask(batch["attention_mask"])).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert (tmp_path / "model" / "tokenizer.json").exists()


def test_full_fine_tuning_lowers_the_validation_loss():
    torch.manual_seed(0)
    module = SFT(base=tiny_spec(), optimizer={"lr": 3e-3})
    data = SFTDataModule(dataset="synthetic", synthetic_rows=400, batch_size=32, val_fraction=0.2)
    trainer = L.Trainer(max_steps=30, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=10,
                        check_val_every_n_epoch=None)
    before = trainer.validate(module, datamodule=data, verbose=False)[0]["sft/val/loss"]
    trainer.fit(module, datamodule=data)
    after = trainer.validate(module, datamodule=data, verbose=False)[0]["sft/val/loss"]
    assert after < before - 0.5
    assert all(p.requires_grad for p in module.parameters())
