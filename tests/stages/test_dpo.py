"""DPO on a tiny GPT-2: a fresh policy is its reference, sequence log-probs are those of a plain forward pass,
gradients reach exactly the policy adapter, a precomputed reference changes nothing, checkpoints resume exactly,
the base is held once, the config runs from the CLI logging every metric, and the export merges into the policy."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM

from rlhf_lightning import DPO, PreferenceDataModule
from rlhf_lightning.algorithms.preference_losses import SimPO
from rlhf_lightning.cli import main
from rlhf_lightning.cli.merge_command import merge_adapter
from rlhf_lightning.models.shared_base import adapter_of, position_ids_from_mask
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.stages.dpo import PAIR_METRICS
from tests.helpers.cli import logged_keys
from tests.helpers.offline import make_dpo, pairs, perturb_policy

REPO = Path(__file__).resolve().parents[2]


def first_batch(module: DPO) -> dict:
    return next(iter(pairs(module).train_dataloader()))


@pytest.mark.parametrize("bad, message", [
    (dict(beta=0.0), "beta must be > 0"),
    (dict(preference_loss=SimPO(gamma=1.0), beta=-2.0), "beta must be > 0"),
    (dict(rpo_alpha=-1.0), "rpo_alpha must be >= 0"),
    (dict(optimizer={"lr": 0.0}), "optimizer.lr must be > 0, got 0.0"),
    (dict(optimizer={"adam_eps": -1e-8}), "optimizer.adam_eps must be > 0, got -1e-08"),
])
def test_bad_arguments_fail_before_the_model_is_loaded(bad, message):
    with pytest.raises(ValueError, match=message):  # the base path does not exist: no model was loaded
        DPO(base=BaseModelSpec(name_or_path="/nonexistent/model"), **bad)


def test_pairs_carry_the_response_mask_and_left_padded_prompts(tiny_model_dir):
    module = make_dpo(tiny_model_dir)
    data = pairs(module)
    batch = data.collate(data.train_set[:4])
    tokenizer = module.tokenizer
    assert batch["index"].tolist() == [0, 1, 2, 3]
    for row, pair in enumerate(data.train_set[:4]):
        for ids, offset in ((pair.chosen_ids, 0), (pair.rejected_ids, 4)):
            marked = batch["input_ids"][row + offset][batch["response_mask"][row + offset]].tolist()
            assert marked == ids[pair.prompt_length:] and marked[-1] == tokenizer.eos_token_id  # EOS, no padding
        prompt = batch["prompt_input_ids"][row][batch["prompt_attention_mask"][row].bool()].tolist()
        assert prompt == pair.chosen_ids[: pair.prompt_length] == pair.rejected_ids[: pair.prompt_length]
    assert (batch["prompt_attention_mask"][:, -1] == 1).all()  # left padding: every prompt ends in the last column
    assert (batch["attention_mask"][:, 0] == 1).all()  # right padding for the pairs


def test_fresh_policy_has_zero_implicit_reward_and_sigmoid_loss_log_2(tiny_model_dir):
    module = make_dpo(tiny_model_dir)
    batch = first_batch(module)
    loss, values = module.batch_losses(batch, "train")
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert values[name].abs().max().item() < 1e-6, name
    assert values["rewards/accuracy"].sum().item() == 0  # ties count as wrong
    assert (values["logps/chosen"] < 0).all() and (values["logps/rejected"] < 0).all()
    module.eval()
    prompts = {"input_ids": batch["prompt_input_ids"], "attention_mask": batch["prompt_attention_mask"],
               "prompt": module.policy.decode(batch["prompt_input_ids"], batch["prompt_attention_mask"])}
    samples = module.held_out.evaluate(prompts, 0)
    assert samples["kl"].abs().max().item() < 1e-6 and samples["gold"].shape == (8,)


def test_sequence_logps_equal_a_plain_transformers_forward_without_padding(tiny_model_dir, tmp_path):
    module = make_dpo(tiny_model_dir)
    perturb_policy(module)
    data = pairs(module)
    examples = data.train_set[:8]
    batch = data.collate(examples)
    sequences = [pair.chosen_ids for pair in examples] + [pair.rejected_ids for pair in examples]
    prompt_lengths = [pair.prompt_length for pair in examples] * 2
    response_lengths = [len(ids) - start for ids, start in zip(sequences, prompt_lengths, strict=True)]
    assert len(set(prompt_lengths)) > 1 and len(set(response_lengths)) > 1  # the case being tested
    assert (batch["attention_mask"] == 0).any()  # and there is padding to exclude

    merged = merge_adapter(module.export(tmp_path / "adapters")["policy"], tmp_path / "merged", str(tiny_model_dir))
    for role, path in (("policy", merged), (None, tiny_model_dir)):
        model = AutoModelForCausalLM.from_pretrained(path)
        expected = []
        for ids, start in zip(sequences, prompt_lengths, strict=True):
            tokens = torch.tensor([ids])  # one unpadded sequence, default positions
            logprobs = model(tokens).logits[0, :-1].log_softmax(-1).gather(-1, tokens[0, 1:, None])[:, 0]
            expected.append(logprobs[start - 1:].sum())  # position t-1 predicts token t
        with torch.no_grad():
            actual = module.sequence_logps(role, batch)
        torch.testing.assert_close(actual, torch.stack(expected).detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [dict(), dict(preference_loss=SimPO(), beta=2.0, rpo_alpha=0.5)],
                         ids=["sigmoid", "simpo+rpo"])
def test_gradients_reach_exactly_the_policy_adapter(tiny_model_dir, options):
    module = make_dpo(tiny_model_dir, **options)
    perturb_policy(module)
    loss, _ = module.batch_losses(first_batch(module), "train")
    policy = {name for name, _ in module.named_parameters() if adapter_of(name) == "policy"}
    assert policy and {name for name, p in module.named_parameters() if p.requires_grad} == policy
    loss.backward()
    reached = {name for name, p in module.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert reached == policy


def test_the_process_holds_one_copy_of_the_base(tiny_model_dir):
    module = make_dpo(tiny_model_dir)
    base_numel = sum(p.numel() for _, p in module.model.base_parameters())
    assert base_numel == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    storages = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes() // tensor.element_size()
    adapter_numel = sum(p.numel() for n, p in module.model.model.named_parameters() if adapter_of(n))
    assert sum(storages.values()) <= base_numel + adapter_numel + 4096  # + small buffers


class Recorder(L.Callback):
    """Each training step's logged dpo/* values; which roles ran a forward pass, and in which phase."""

    def __init__(self, module: DPO) -> None:
        self.rows: list[dict[str, float]] = []
        self.phase = "before training"
        self.passes: list[tuple[str, str | None]] = []
        sequence_logps = module.sequence_logps

        def recording(role, batch):
            self.passes.append((self.phase, role))
            return sequence_logps(role, batch)

        module.sequence_logps = recording

    def on_train_start(self, trainer, pl_module) -> None:
        self.phase = "training"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("dpo/")})


def fit(module: DPO, data: PreferenceDataModule, directory: Path, steps: int, ckpt_path: str | None = None):
    recorder = Recorder(module)
    trainer = L.Trainer(
        max_steps=steps, limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, log_every_n_steps=1, accelerator="cpu",
        callbacks=[recorder, ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1,
                                             enable_version_counter=False)],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return recorder


def test_precomputed_and_on_the_fly_reference_give_the_same_losses(tiny_model_dir, tmp_path):
    recorders = {}
    for precompute in (False, True):
        module = make_dpo(tiny_model_dir, precompute_reference=precompute)
        data = pairs(module, n=40)
        recorders[precompute] = fit(module, data, tmp_path / str(precompute), steps=3)
    on_the_fly, precomputed = recorders[False], recorders[True]
    assert ("training", None) in on_the_fly.passes and ("training", None) not in precomputed.passes
    assert ("before training", None) in precomputed.passes
    assert module.reference_tables["train"][1].shape == (2, len(data.train_set))
    assert module.reference_tables["val"][1].shape == (2, len(data.val_set))
    assert on_the_fly.rows[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    for expected, actual in zip(on_the_fly.rows, precomputed.rows, strict=True):
        assert actual.keys() == expected.keys()
        for name in expected:
            assert actual[name] == pytest.approx(expected[name], abs=1e-5), name


def test_resume_reproduces_the_next_steps_exactly_without_recomputing_the_reference(tiny_model_dir, tmp_path):
    options = dict(precompute_reference=True, optimizer={"warmup": 1, "schedule": "linear"}, rpo_alpha=0.1)
    module = make_dpo(tiny_model_dir, **options)
    uninterrupted = fit(module, pairs(module, n=48), tmp_path / "full", steps=4).rows
    checkpoint = tmp_path / "full" / "epoch=0-step=2.ckpt"
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["state_dict"] and all(adapter_of(key) == "policy" for key in saved["state_dict"])
    assert set(saved["dpo_reference"]) == {"train", "val"}

    resumed_module = make_dpo(tiny_model_dir, **options)
    resumed_module.compute_reference = lambda *args: pytest.fail("the reference was recomputed on resume")
    resumed = fit(resumed_module, pairs(resumed_module, n=48), tmp_path / "resumed", steps=4,
                  ckpt_path=str(checkpoint)).rows
    assert len(resumed) == 2 and resumed == uninterrupted[2:]

    other_data = make_dpo(tiny_model_dir, **options)
    with pytest.raises(ValueError, match="computed on other data"):
        fit(other_data, pairs(other_data, n=56), tmp_path / "other", steps=4, ckpt_path=str(checkpoint))


def test_export_and_merge_give_the_policy(tiny_model_dir, tmp_path):
    module = make_dpo(tiny_model_dir)
    perturb_policy(module)
    adapter = module.export(tmp_path / "adapters")["policy"]
    main(["merge", "--adapter", str(adapter), "--out", str(tmp_path / "merged"), "--base", str(tiny_model_dir)])
    batch = first_batch(module)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad(), module.model.role("policy"):
        expected = module.model.lm_head(module.model.hidden_states(ids, mask))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    logits = merged(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_config_runs_from_the_cli_logs_every_metric_and_exports(tiny_model_dir, tmp_path):
    main(["fit", "--config", str(REPO / "configs" / "dpo.yaml"), "--trainer.accelerator=cpu",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          "--trainer.log_every_n_steps=1", "--trainer.max_steps=3", "--trainer.val_check_interval=3",
          f"--model.init_args.base.name_or_path={tiny_model_dir}", "--model.init_args.policy_lora={r: 4, alpha: 8}",
          "--model.init_args.sampling.max_new_tokens=4", "--model.init_args.rpo_alpha=0.5",
          "--data.init_args.synthetic_rows=80", "--data.init_args.val_fraction=0.1",
          "--data.init_args.batch_size=8", "--data.init_args.val_batch_size=8"])
    assert (tmp_path / "outputs/dpo/adapters/policy/adapter_config.json").exists()
    assert (tmp_path / "outputs/dpo/checkpoints/last.ckpt").exists()
    train = {f"dpo/{name}" for name in PAIR_METRICS} | {"dpo/lr"}
    val = {f"dpo/val/{name}" for name in (*PAIR_METRICS, "gold", "kl", "length", "eos_frac")}
    missing = (train | val) - logged_keys(tmp_path / "outputs/dpo", train | val)
    assert not missing, missing
