"""Data modules: tokenization, masking, formats end to end, length limits, resumable batches."""

from __future__ import annotations

import json
import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from rlhf_lightning.data.collate import IGNORE_INDEX
from rlhf_lightning.data.loader import ResumableLoader
from rlhf_lightning.data.modules import PreferenceDataModule, PromptDataModule, SFTDataModule
from rlhf_lightning.data.sources import DataFormatError
from rlhf_lightning.tasks.synthetic import build_tokenizer


def _module(cls, dataset, **kwargs):
    module = cls(dataset=dataset, val_fraction=kwargs.pop("val_fraction", 0.0), **kwargs)
    module.tokenizer = build_tokenizer()
    module.setup("fit")
    return module


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_sft_labels_mask_prompt_and_padding_and_end_with_eos(tmp_path):
    data = _jsonl(tmp_path / "sft.jsonl", [
        {"prompt": "the cat", "completion": " is good ."},
        {"prompt": "a big dog", "completion": " sees the river . the cat is kind ."},
    ])
    module = _module(SFTDataModule, data, batch_size=2)
    tokenizer = module.tokenizer
    batch = module.collate(module.train_set)
    eos = tokenizer.eos_token_id
    # row 0: 2 prompt tokens, "is good ." + EOS, then right padding
    assert batch["input_ids"][0, :6].tolist() == tokenizer("the cat is good .")["input_ids"] + [eos]
    assert batch["labels"][0].tolist()[:6] == [IGNORE_INDEX, IGNORE_INDEX, *batch["input_ids"][0, 2:6].tolist()]
    assert (batch["labels"][0, 6:] == IGNORE_INDEX).all() and (batch["attention_mask"][0, 6:] == 0).all()
    assert batch["labels"][1, :3].tolist() == [IGNORE_INDEX] * 3
    assert batch["labels"][1, -1].item() == eos


def test_text_and_messages_formats(tmp_path):
    data = _jsonl(tmp_path / "sft.jsonl", [
        {"text": "the cat is good ."},
        {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "is good ."}]},
    ])
    module = _module(SFTDataModule, data, batch_size=2)
    tokenizer = module.tokenizer
    text, conversation = module.train_set
    assert text.prompt_length == 0  # loss on every token
    assert tokenizer.decode(conversation.input_ids[: conversation.prompt_length]) == "<user> the cat <assistant>"
    assert tokenizer.decode(conversation.input_ids[conversation.prompt_length:]) == "is good . <eos>"


def test_conversational_data_without_chat_template_names_the_row(tmp_path):
    data = _jsonl(tmp_path / "sft.jsonl", [
        {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "is good ."}]},
    ])
    module = SFTDataModule(dataset=data, val_fraction=0.0)
    module.tokenizer = build_tokenizer()
    module.tokenizer.chat_template = None
    with pytest.raises(DataFormatError, match=r"sft.jsonl line 1: .*chat template"):
        module.setup("fit")


def test_hh_style_preferences_load_and_stack_chosen_then_rejected(tmp_path):
    data = _jsonl(tmp_path / "hh.jsonl", [
        {"chosen": "<user> the cat <assistant> is good .", "rejected": "<user> the cat <assistant> is bad ."},
        {"chosen": "the dog likes a kind river .", "rejected": "the dog likes a sad river .", "margin": 1.5},
    ])
    module = _module(PreferenceDataModule, data, batch_size=2)
    tokenizer = module.tokenizer
    batch = module.collate(module.train_set)
    assert batch["input_ids"].shape[0] == 4
    decoded = [tokenizer.decode(row[mask.bool()]) for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]
    assert decoded == [
        "<user> the cat <assistant> is good . <eos>",
        "the dog likes a kind river . <eos>",
        "<user> the cat <assistant> is bad . <eos>",
        "the dog likes a sad river . <eos>",
    ]
    assert batch["margin"].tolist() == [0.0, 1.5]
    assert (batch["input_ids"][torch.arange(4), batch["last_index"]] == tokenizer.eos_token_id).all()


def test_conversational_preferences_load(tmp_path):
    data = _jsonl(tmp_path / "chat.jsonl", [{
        "prompt": [{"role": "user", "content": "the cat"}],
        "chosen": [{"role": "assistant", "content": "is good ."}],
        "rejected": [{"role": "assistant", "content": "is bad ."}],
    }])
    module = _module(PreferenceDataModule, data, batch_size=1)
    pair = module.train_set[0]
    assert module.tokenizer.decode(pair.chosen_ids) == "<user> the cat <assistant> is good . <eos>"
    assert module.tokenizer.decode(pair.rejected_ids) == "<user> the cat <assistant> is bad . <eos>"


def test_synthetic_preferences_carry_gold_scores():
    module = _module(PreferenceDataModule, "synthetic", synthetic_rows=64, batch_size=8, val_fraction=0.25)
    assert len(module.train_set) == 48 and len(module.val_set) == 16
    batch = next(iter(module.train_dataloader()))
    assert batch["gold_chosen"].shape == (8,) and batch["input_ids"].shape[0] == 16


def test_label_noise_labels_the_same_pairs_by_the_gold_order_flipped_at_that_rate():
    def pairs(**kwargs):
        rows = PreferenceDataModule(dataset="synthetic", **kwargs).synthetic(2000)
        return [(r["prompt"], *sorted([r["chosen"], r["rejected"]])) for r in rows], \
            sum(r["gold_chosen"] > r["gold_rejected"] for r in rows) / len(rows)

    sampled, sampled_agreement = pairs()
    noiseless, noiseless_agreement = pairs(label_noise=0.0)
    noisy, noisy_agreement = pairs(label_noise=0.25)
    assert sampled == noiseless == noisy  # the same pairs, labelled three ways
    assert noiseless_agreement == 1.0
    assert 0.72 < noisy_agreement < 0.78 and 0.82 < sampled_agreement < 0.88  # the task's own: 85%
    with pytest.raises(ValueError, match="label_noise must lie in"):
        PreferenceDataModule(label_noise=1.5)
    with pytest.raises(ValueError, match="label_noise: the embedded task 'arithmetic' labels its pairs its own way"):
        PreferenceDataModule(dataset="arithmetic", label_noise=0.1).synthetic(10, "arithmetic")


def test_over_long_examples_are_skipped_with_a_log_or_raise(tmp_path, caplog):
    data = _jsonl(tmp_path / "sft.jsonl", [
        {"prompt": "the cat", "completion": " is good ."},
        {"prompt": "the cat", "completion": " is good . the dog is kind . the river is warm ."},
    ])
    with caplog.at_level(logging.WARNING):
        module = _module(SFTDataModule, data, max_length=8, batch_size=1)
    assert len(module.train_set) == 1
    assert "skipped 1 of 2" in caplog.text and "sft.jsonl line 2" in caplog.text
    with pytest.raises(DataFormatError, match=r"sft.jsonl line 2: 16 tokens, over max_length=8"):
        _module(SFTDataModule, data, max_length=8, on_too_long="error")


def test_empty_file_is_a_clear_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataFormatError, match="empty.jsonl"):
        _module(PreferenceDataModule, str(tmp_path / "empty.jsonl"))


def test_prompts_are_left_padded_with_their_texts():
    module = _module(PromptDataModule, "synthetic", synthetic_rows=16, batch_size=4)
    batch = next(iter(module.train_dataloader()["prompts"]))
    assert (batch["attention_mask"][:, -1] == 1).all()  # left padding: every prompt ends at the last column
    for ids, mask, text in zip(batch["input_ids"], batch["attention_mask"], batch["prompt"], strict=True):
        assert module.tokenizer.decode(ids[mask.bool()]) == text


def test_resumable_loader_continues_exactly_and_reshuffles_per_epoch():
    data = list(range(10))
    loader = ResumableLoader(data, batch_size=3, collate_fn=list, seed=5)
    assert len(loader) == 3
    epoch0 = list(loader)
    epoch1 = list(loader)
    assert epoch0 != epoch1 and sorted(sum(epoch0, [])) != data  # drop_last leaves one element out
    # stop after two batches of epoch 2, save, resume in a fresh loader
    iterator = iter(loader)
    first_two = [next(iterator), next(iterator)]
    state = loader.state_dict()
    uninterrupted = first_two + list(iterator)
    resumed = ResumableLoader(data, batch_size=3, collate_fn=list, seed=5)
    resumed.load_state_dict(state)
    assert first_two + list(resumed) == uninterrupted
    # a checkpoint taken after the last batch of an epoch resumes at the next epoch
    at_end = ResumableLoader(data, batch_size=3, collate_fn=list, seed=5)
    at_end.load_state_dict({"epoch": 0, "batches_done": 3})
    assert list(at_end) == epoch1
    with pytest.raises(ValueError, match="no batch"):
        ResumableLoader([1, 2], batch_size=3, collate_fn=list)


class _RecordingModule(L.LightningModule):
    """Trains a scalar on the loader's batches (lists of ints) and records them."""

    def __init__(self, data: list[int]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.data, self.seen = data, []

    def train_dataloader(self) -> ResumableLoader:
        return ResumableLoader(self.data, batch_size=3, collate_fn=list, seed=5, limit=self.trainer.limit_train_batches)

    def training_step(self, batch: list[int], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch)
        return self.weight * float(sum(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_epoch_cut_by_limit_train_batches_is_followed_by_a_whole_new_one(tmp_path):
    data = list(range(10))
    reference = ResumableLoader(data, batch_size=3, collate_fn=list, seed=5)
    epochs = [list(reference) for _ in range(3)]
    settings = dict(limit_train_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    default_root_dir=tmp_path)
    module = _RecordingModule(data)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1)
    L.Trainer(max_epochs=3, callbacks=[checkpoint], **settings).fit(module)
    assert module.seen == epochs[0][:2] + epochs[1][:2] + epochs[2][:2]
    # resumed from the checkpoint written when the cut first epoch ended: the second epoch from its start
    resumed = _RecordingModule(data)
    L.Trainer(max_epochs=3, **settings).fit(resumed, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert resumed.seen == epochs[1][:2] + epochs[2][:2]


def test_a_run_stopped_mid_epoch_by_max_steps_resumes_where_it_stopped(tmp_path):
    # Lightning counts the epoch a max_steps stop cut short as ended and starts "epoch 1" on resume; the loader
    # must go on with epoch 0's remaining batches, as the uninterrupted run does.
    data = list(range(12))  # four batches of three per epoch
    settings = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    uninterrupted = _RecordingModule(data)
    L.Trainer(max_steps=6, enable_checkpointing=False, **settings).fit(uninterrupted)
    first = _RecordingModule(data)
    L.Trainer(max_steps=3, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)], **settings).fit(first)
    resumed = _RecordingModule(data)
    L.Trainer(max_steps=6, enable_checkpointing=False, **settings).fit(resumed, ckpt_path=str(tmp_path / "last.ckpt"))
    assert first.seen + resumed.seen == uninterrupted.seen
    assert len(resumed.seen) == 3
