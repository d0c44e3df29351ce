"""Bad model files fail with one line before transformers is asked, and the tokenizer must fit the model: a folder
without a tokenizer, a local folder that does not exist, another model's tokenizer, ``null`` on the command line,
and reward adapters trained on another base."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_lightning import (
    DPO,
    GRPO,
    KTO,
    PPO,
    RLOO,
    SFT,
    AdapterReward,
    OnlineDPO,
    REINFORCEPlusPlus,
    RewardModel,
)
from rlhf_lightning.cli import RLHFCLI, main
from rlhf_lightning.models.fingerprint import BASE_RECORD
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from tests.helpers.models import LORA, built

REPO = Path(__file__).resolve().parents[2]


def save_gpt2(directory: Path, vocab_size: int, n_embd: int = 32, weights: bool = True) -> Path:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=n_embd, n_head=2, n_positions=64, vocab_size=vocab_size,
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(directory)
    if not weights:
        (directory / "model.safetensors").unlink()
    return directory


def test_a_model_folder_without_a_tokenizer_is_refused(tmp_path):
    folder = save_gpt2(tmp_path / "model", vocab_size=64)
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(folder))} holds no tokenizer \(none of "
                                                rf"tokenizer.json, tokenizer_config.json, vocab.json\.\.\.\): set "
                                                rf"base.tokenizer"):
        built(SFT(base=BaseModelSpec(name_or_path=str(folder))))


def test_a_tokenizer_without_a_vocabulary_is_refused(tmp_path):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps({"<|endoftext|>": 0}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    with pytest.raises(ValueError, match=r"^tokenizer '.*tokenizer' \(1 tokens\) encodes 'Hello, world. 1 2 3' "
                                         r"to \[.*\] and back to nothing: it has no usable vocabulary"):
        load_tokenizer(BaseModelSpec(tokenizer=str(folder)))


@pytest.mark.parametrize("spec, message", [
    (BaseModelSpec(name_or_path="outputs/sft/model"),
     "model folder outputs/sft/model does not exist (run the SFT stage first?)"),
    (BaseModelSpec(name_or_path="./models/missing"), "model folder ./models/missing does not exist"),
    (BaseModelSpec(name_or_path="~/no-such-model-here", tokenizer="synthetic"),
     "model folder ~/no-such-model-here does not exist"),
    (BaseModelSpec(name_or_path="gpt2", tokenizer="/no/such/tokenizer"),
     "tokenizer folder /no/such/tokenizer does not exist"),
])
def test_a_missing_local_folder_is_named_not_taken_for_a_hub_id(spec, message):
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(message)}$"):
        built(SFT(base=spec))


def test_a_partly_existing_path_is_a_local_folder(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="^model folder checkpoints/sft does not exist$"):
        built(SFT(base=BaseModelSpec(name_or_path="checkpoints/sft")))


@pytest.mark.parametrize("vocab_size, reason", [
    (1000, "it covers fewer than half of the model's 1000 embedding rows"),
    (40, "its ids reach 63, beyond the model's 40 embedding rows"),
])
def test_the_synthetic_tokenizer_on_another_model_is_refused_before_its_weights_load(tmp_path, vocab_size, reason):
    folder = save_gpt2(tmp_path / "model", vocab_size=vocab_size, weights=False)  # the config alone decides
    with pytest.raises(ValueError, match=rf"^tokenizer 'synthetic' \(\d+ tokens\) does not fit model "
                                         rf"'{re.escape(str(folder))}': {re.escape(reason)}; set base.tokenizer"):
        built(SFT(base=BaseModelSpec(name_or_path=str(folder), tokenizer="synthetic")))


def test_the_synthetic_tokenizer_fits_a_model_trained_with_it(tiny_model_dir):
    module = built(SFT(base=BaseModelSpec(name_or_path=str(tiny_model_dir), tokenizer="synthetic")))
    assert len(module.tokenizer) == module.model.hf_model.get_input_embeddings().num_embeddings


@pytest.mark.parametrize("value", ["null", "None"])
def test_null_on_the_command_line_means_none(tiny_model_dir, value):
    """jsonargparse hands ``--...base.tokenizer=null`` to the nested dataclass as the string "None"."""
    cli = RLHFCLI(args=["--config", str(REPO / "configs" / "sft.yaml"), f"--model.init_args.base.tokenizer={value}",
                        f"--model.init_args.base.name_or_path={tiny_model_dir}", "--trainer.logger=false"],
                  run=False)
    assert BaseModelSpec(**cli.model.hparams.base).tokenizer is None  # as a checkpoint's hparams rebuild it
    cli.model.configure_model()
    # the tokenizer is the model folder's (a network error before: "None" was taken for a hub id)
    assert len(cli.model.tokenizer) == cli.model.model.hf_model.get_input_embeddings().num_embeddings


def _adapter_on(base_dir: Path, out: Path) -> Path:
    spec = BaseModelSpec(name_or_path=str(base_dir))
    base = SharedBase(load_causal_lm(spec, load_tokenizer(spec)))
    base.add_adapter("reward", LORA)
    base.add_head("reward")
    return base.save_adapter("reward", out)


def test_a_reward_adapter_of_another_shape_is_refused_in_one_line(tiny_model_dir, tmp_path):
    other = save_gpt2(tmp_path / "other", vocab_size=65, n_embd=16)
    shutil.copy(tiny_model_dir / "tokenizer.json", other)
    shutil.copy(tiny_model_dir / "tokenizer_config.json", other)
    adapter = _adapter_on(other, tmp_path / "adapters")
    with pytest.raises(ValueError, match=rf"^adapter {re.escape(str(adapter))} does not fit the base \(trained on "
                                         rf"{re.escape(str(other))}, loaded on {re.escape(str(tiny_model_dir))}\): "
                                         r"layer transformer.h.0.attn.c_attn maps 16 -> 48 features in the adapter "
                                         r"but 32 -> 96 in the base; load it on the model it was trained on"):
        built(GRPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), reward=AdapterReward(str(adapter)),
                   policy_lora=LORA))


def test_a_reward_adapter_from_another_path_of_the_same_weights_loads_and_an_older_one_warns_naming_both(
        tiny_model_dir, reward_dir, tmp_path, caplog):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    older = shutil.copytree(reward_dir, tmp_path / "older")  # as exported before base fingerprints were recorded
    (older / BASE_RECORD).unlink()
    with caplog.at_level(logging.WARNING):
        built(GRPO(base=BaseModelSpec(name_or_path=str(copy)), reward=AdapterReward(str(reward_dir)), policy_lora=LORA))
        assert not [r for r in caplog.records if "trained on" in r.getMessage()]  # the fingerprints agree
        built(GRPO(base=BaseModelSpec(name_or_path=str(copy)), reward=AdapterReward(str(older)), policy_lora=LORA))
    warnings = [r.getMessage() for r in caplog.records if "trained on" in r.getMessage()]
    assert len(warnings) == 1 and str(tiny_model_dir) in warnings[0] and str(copy) in warnings[0]


@pytest.mark.parametrize("cls", [SFT, RewardModel, PPO, GRPO, RLOO, REINFORCEPlusPlus, DPO, KTO, OnlineDPO])
def test_constructing_a_module_reads_no_weights(cls, tiny_model_dir, reward_dir, tmp_path):
    """A weights file of garbage: every module is constructed (arguments stored and checked), and the error comes
    when the model is built, as one line naming the folder."""
    folder = shutil.copytree(tiny_model_dir, tmp_path / "garbage")
    (folder / "model.safetensors").write_bytes(b"\x10" * 4 + bytes(range(256)) * 4)
    kwargs = {"reward": AdapterReward(str(reward_dir))} if cls not in (SFT, RewardModel, DPO, KTO) else {}
    module = cls(base=BaseModelSpec(name_or_path=str(folder)), **kwargs)
    assert module.model is None and len(module.tokenizer) == 64  # the tokenizer is cheap and read on demand
    with pytest.raises(ValueError, match=rf"^model {re.escape(str(folder))}: its weights cannot be read "
                                         r"\(Error while deserializing header: .*\); copy or save the model again$"):
        module.configure_model()


def test_a_corrupt_weights_file_is_one_line_from_the_command_line(tiny_model_dir, tmp_path, capsys):
    folder = shutil.copytree(tiny_model_dir, tmp_path / "garbage")
    (folder / "model.safetensors").write_bytes(b"\x10" * 4 + bytes(range(256)) * 4)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "sft.yaml"), f"--model.init_args.base.name_or_path={folder}",
              "--trainer.logger=false", "--trainer.max_steps=1",
              "--trainer.enable_progress_bar=false", "--data.init_args.synthetic_rows=40"])
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"error: model {folder}: its weights cannot be read") and "Traceback" not in lines
