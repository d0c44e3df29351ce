"""The architecture matrix: tiny random Llama, Qwen2, Mistral, Gemma, Gemma-2, Phi, GPT-NeoX and OPT models, each
with a BPE tokenizer trained here and its family's style of chat template (``tests/helpers/families.py``).

For each: log-probs and entropies of every role equal transformers' own forward pass (logit post-processing such
as Gemma-2's soft cap included); completions end where generation stops (no doubled EOS after ChatML's newline,
Gemma's ``<end_of_turn>``); one SFT, reward and PPO step through the CLI; the merged policy reloads equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from rlhf_lightning.cli import main
from rlhf_lightning.data.collate import pad
from rlhf_lightning.data.tokenize import encode_completion, encode_prompt, turn_end_token_id
from rlhf_lightning.models.shared_base import position_ids_from_mask
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rollout.settings import stop_token_ids
from rlhf_lightning.stages.dpo import DPO
from tests.helpers.families import FAMILIES, Family, build_model_dir, build_tokenizer, prompts
from tests.helpers.models import LORA, built

NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module", params=NAMES)
def family_dir(request, tmp_path_factory) -> tuple[Family, Path]:
    family = FAMILIES[request.param]
    # Large output embeddings: logits of tens of nats, where a skipped soft cap shows.
    return family, build_model_dir(family, tmp_path_factory.mktemp(family.name), logit_scale=20.0)


def _perturbed_policy(directory: Path, **kwargs) -> DPO:
    module = built(DPO(BaseModelSpec(name_or_path=str(directory)), LORA, sampling={"max_new_tokens": 12},
                                **kwargs))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in module.model.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    return module


def _forward_logprobs(module: DPO, role, ids, mask, width):
    """Log-probs and entropies of the last ``width`` tokens from transformers' own forward pass."""
    with torch.no_grad(), module.model.role(role):
        logits = module.model.hf_model(input_ids=ids, attention_mask=mask,
                                       position_ids=position_ids_from_mask(mask)).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, -1)
    picked = logprobs.gather(-1, ids[:, 1:, None])[..., 0]
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return picked[:, -width:], entropy[:, -width:]


def test_logprobs_of_every_role_equal_the_models_own_forward(family_dir, record_property):
    family, directory = family_dir
    module = _perturbed_policy(directory)
    tokenizer = module.tokenizer
    ids, mask = pad([encode_prompt(tokenizer, p, "test") for p in prompts(family, 4)], tokenizer.pad_token_id, "left")
    torch.manual_seed(0)
    sequences, sequence_mask, response_mask = module.policy.generate(ids, mask)
    worst = 0.0
    for role in ("policy", None):
        expected, expected_entropy = _forward_logprobs(module, role, sequences, sequence_mask, response_mask.shape[1])
        for chunk in (None, 5):
            module.hparams.logprob_chunk = chunk
            logprobs, entropy = module.policy.response_logprobs(role, sequences, sequence_mask, response_mask,
                                                         with_entropy=True)
            worst = max(worst, float(((logprobs - expected).abs() * response_mask).max()))
            assert ((entropy - expected_entropy).abs() * response_mask).max() < 1e-4
    record_property("max_logprob_difference", worst)
    print(f"{family.name}: largest |log-prob - transformers' forward| = {worst:.2e}")
    assert worst <= 1e-5
    # The sampled responses are the policy's: different from the reference's once the adapter is perturbed.
    assert response_mask.any()


def test_gemma2_soft_cap_matters_here_and_is_applied(tmp_path):
    """Without its soft cap the LM head alone is tens of nats off, so the matrix above can fail."""
    module = _perturbed_policy(build_model_dir(FAMILIES["gemma2"], tmp_path, logit_scale=20.0))
    assert module.model.logit_transform.softcap == 0.5
    ids = torch.arange(3, 19)[None]
    hidden = module.model.hidden_states(ids, torch.ones_like(ids))
    capped = module.model.logits(hidden)
    raw = module.model.lm_head(hidden)
    assert (raw - capped).abs().max() > 5.0
    assert capped.abs().max() <= 0.5 + 1e-6


@pytest.mark.parametrize("model_type, fields, expected", [
    ("cohere", {"logit_scale": 0.25}, (0.25, None)),
    ("granite", {"logits_scaling": 4.0}, (0.25, None)),
    ("gemma3_text", {"final_logit_softcapping": 0.5, "head_dim": 8, "sliding_window": 32}, (1.0, 0.5)),
])
def test_logit_post_processing_of_other_families_is_recognised(tmp_path, model_type, fields, expected):
    family = Family(model_type, {"model_type": model_type, "num_hidden_layers": 1, "hidden_size": 32,
                                 "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 **fields}, {"eos": "</s>", "pad": "<pad>"}, conversational=False)
    module = _perturbed_policy(build_model_dir(family, tmp_path, logit_scale=20.0))
    transform = module.model.logit_transform
    assert (transform.scale, transform.softcap) == pytest.approx(expected)
    ids = torch.arange(3, 15)[None].repeat(2, 1)
    mask = torch.ones_like(ids)
    response_mask = torch.zeros_like(ids, dtype=torch.bool)
    response_mask[:, 6:] = True
    logprobs, _ = module.policy.token_logprobs("policy", ids, mask, response_mask)
    expected_logprobs, _ = _forward_logprobs(module, "policy", ids, mask, ids.shape[1] - 6)
    torch.testing.assert_close(logprobs[:, 6:], expected_logprobs, atol=1e-5, rtol=0)


def test_an_unrecognised_post_processing_is_detected_and_log_probs_use_the_full_forward(tmp_path):
    """A model class (as with ``trust_remote_code``) that adds a per-token bias to its logits: no transform of the
    LM head's output reproduces it, so the probe says so and log-probs come from the model's own forward pass."""
    from transformers import LlamaForCausalLM

    from rlhf_lightning.models.logits import find_logit_transform
    from rlhf_lightning.models.shared_base import SharedBase

    class BiasedLlama(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits + torch.linspace(-3.0, 3.0, output.logits.shape[-1])
            return output

    directory = build_model_dir(FAMILIES["llama"], tmp_path, logit_scale=20.0)
    biased = BiasedLlama.from_pretrained(directory)
    assert SharedBase(LlamaForCausalLM.from_pretrained(directory)).logit_transform is not None
    shared = SharedBase(biased)
    assert shared.logit_transform is None
    assert find_logit_transform(biased, shared.hidden_states) is None
    ids = torch.arange(3, 15)[None]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = biased(input_ids=ids, attention_mask=mask).logits[:, 4:-1]
        torch.testing.assert_close(shared.next_token_logits(ids, mask, start=5), expected)

    module = _perturbed_policy(directory)
    module.model.logit_transform = None  # the fallback path on a model whose head we know, to compare with
    response_mask = torch.zeros_like(ids, dtype=torch.bool)
    response_mask[:, 6:] = True
    logprobs, entropy = module.policy.token_logprobs("policy", ids, mask, response_mask, with_entropy=True)
    expected_logprobs, expected_entropy = _forward_logprobs(module, "policy", ids, mask, ids.shape[1] - 6)
    torch.testing.assert_close(logprobs[:, 6:], expected_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[:, 6:], expected_entropy, atol=1e-5, rtol=0)
    assert (logprobs[:, :6] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_completions_end_where_generation_stops(name):
    family = FAMILIES[name]
    tokenizer = build_tokenizer(family)
    prompt = prompts(family, 1)[0]
    completion = [{"role": "assistant", "content": "five."}] if family.conversational else " five."
    prompt_ids = encode_prompt(tokenizer, prompt, "test")
    completion_ids = encode_completion(tokenizer, prompt, completion, prompt_ids, "test")
    end = tokenizer.convert_tokens_to_ids(family.turn_end) if family.turn_end else tokenizer.eos_token_id
    assert completion_ids[-1] == end
    assert completion_ids.count(end) == 1 and completion_ids.count(tokenizer.eos_token_id) <= 1
    assert turn_end_token_id(tokenizer) == (end if family.turn_end else None)
    # generation stops at that token (and at EOS)
    assert set(stop_token_ids(tokenizer, "auto")) == {end, tokenizer.eos_token_id}


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _data_files(family: Family, directory: Path) -> dict[str, str]:
    texts = prompts(family, 8)
    answers = ["five.", "the sea is wide and blue.", "fig pear.", "i am well, thank you."]
    rows_sft, rows_pairs = [], []
    for i, prompt in enumerate(texts):
        good, bad = answers[i % 4], answers[(i + 1) % 4]
        if family.conversational:
            rows_sft.append({"messages": [*prompt, {"role": "assistant", "content": good}]})
            rows_pairs.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": good}],
                               "rejected": [{"role": "assistant", "content": bad}]})
        else:
            rows_sft.append({"prompt": prompt, "completion": " " + good})
            rows_pairs.append({"prompt": prompt, "chosen": " " + good, "rejected": " " + bad})
    return {"sft": _write_jsonl(directory / "sft.jsonl", rows_sft),
            "pairs": _write_jsonl(directory / "pairs.jsonl", rows_pairs),
            "prompts": _write_jsonl(directory / "prompts.jsonl", [{"prompt": p} for p in texts])}


_TRAINER = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
            "limit_val_batches": 0}


def _run(tmp_path: Path, name: str, config: dict) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"seed_everything": 0, **config}))
    main(["fit", "--config", str(path)])


@pytest.mark.slow
def test_sft_reward_ppo_and_merge_through_the_cli(family_dir, tmp_path):
    family, directory = family_dir
    data = _data_files(family, tmp_path)
    lora = {"r": 4, "alpha": 8}
    _run(tmp_path, "sft", {
        "trainer": {**_TRAINER, "max_steps": 1},
        "model": {"class_path": "rlhf_lightning.SFT",
                  "init_args": {"base": {"name_or_path": str(directory)}, "optimizer": {"lr": 1e-3},
                                "export_dir": "sft"}},
        "data": {"class_path": "rlhf_lightning.SFTDataModule",
                 "init_args": {"dataset": data["sft"], "batch_size": 4, "max_length": 64, "val_fraction": 0.0}}})
    assert (tmp_path / "sft/config.json").exists()
    _run(tmp_path, "reward", {
        "trainer": {**_TRAINER, "max_steps": 1},
        "model": {"class_path": "rlhf_lightning.RewardModel",
                  "init_args": {"base": {"name_or_path": "sft"}, "lora": lora, "optimizer": {"lr": 1e-3},
                                "export_dir": "reward"}},
        "data": {"class_path": "rlhf_lightning.PreferenceDataModule",
                 "init_args": {"dataset": data["pairs"], "batch_size": 4, "max_length": 64, "val_fraction": 0.0}}})
    assert (tmp_path / "reward/reward/head.safetensors").exists()
    _run(tmp_path, "ppo", {
        "trainer": {**_TRAINER, "max_epochs": 1, "limit_train_batches": 1},
        "model": {"class_path": "rlhf_lightning.PPO",
                  "init_args": {"base": {"name_or_path": "sft"},
                                "reward": {"class_path": "rlhf_lightning.AdapterReward",
                                           "init_args": {"path": "reward/reward"}},
                                "policy_lora": lora, "critic": {"lora": lora}, "sampling": {"max_new_tokens": 8},
                                "update": {"epochs": 1, "num_minibatches": 1}, "export_dir": "ppo"}},
        "data": {"class_path": "rlhf_lightning.PromptDataModule",
                 "init_args": {"dataset": data["prompts"], "batch_size": 4, "max_length": 64, "val_fraction": 0.0}}})
    main(["merge", "--adapter", str(tmp_path / "ppo/policy"), "--out", str(tmp_path / "merged")])

    module = built(DPO(BaseModelSpec(name_or_path=str(tmp_path / "sft")), LORA))
    module.model.load_adapter(tmp_path / "ppo/policy", "trained")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([encode_prompt(module.tokenizer, prompts(family, 1)[0], "test")])
    with torch.no_grad(), module.model.role("trained"):
        ours = module.model.hf_model(input_ids=ids).logits
    with torch.no_grad():
        theirs = merged(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    with torch.no_grad(), module.model.role(None):
        reference = module.model.hf_model(input_ids=ids).logits
    assert (reference - theirs).abs().max() > 1e-6  # PPO changed the policy: the merge is not the base


@pytest.mark.slow
@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", "float32"), ("bf16-true", "bfloat16"),
                                              ("32-true", "bfloat16")])
def test_every_stage_runs_in_bf16_with_the_static_cache(precision, dtype, tmp_path):
    """SFT, reward, PPO, GRPO and DPO under autocast (``bf16-mixed``) and on true bf16 weights (``base.dtype``),
    generation with the default static KV cache; every exported adapter finite."""
    from safetensors.torch import load_file

    family = FAMILIES["gemma2"]  # soft-capped logits and a turn-end token other than EOS
    directory = build_model_dir(family, tmp_path / "base")
    data = _data_files(family, tmp_path)
    trainer = {**_TRAINER, "precision": precision}
    lora = {"r": 4, "alpha": 8}

    def base(path):
        return {"name_or_path": path, "dtype": dtype}

    def stage(name, module, init_args, data_class, dataset, **limits):
        _run(tmp_path, name, {
            "trainer": {**trainer, **limits},
            "model": {"class_path": f"rlhf_lightning.{module}", "init_args": init_args},
            "data": {"class_path": f"rlhf_lightning.{data_class}",
                     "init_args": {"dataset": dataset, "batch_size": 4, "max_length": 64, "val_fraction": 0.0}}})

    stage("sft", "SFT", {"base": base(str(directory)), "lora": lora, "optimizer": {"lr": 1e-3}, "export_dir": "sft"},
          "SFTDataModule", data["sft"], max_steps=2)
    stage("reward", "RewardModel", {"base": base("sft"), "lora": lora, "optimizer": {"lr": 1e-3},
                                    "export_dir": "reward"},
          "PreferenceDataModule", data["pairs"], max_steps=2)
    online = {"base": base("sft"), "policy_lora": lora, "sampling": {"max_new_tokens": 8, "kv_cache": "static"},
              "reward": {"class_path": "rlhf_lightning.AdapterReward", "init_args": {"path": "reward/reward"}}}
    stage("ppo", "PPO", {**online, "critic": {"lora": lora}, "update": {"epochs": 2, "num_minibatches": 1},
                  "export_dir": "ppo"},
          "PromptDataModule", data["prompts"], max_epochs=1, limit_train_batches=2)
    stage("grpo", "GRPO", {**online, "samples_per_prompt": 2, "kl": {"coef": 0.1}, "export_dir": "grpo"},
          "PromptDataModule", data["prompts"], max_epochs=1, limit_train_batches=2)
    stage("dpo", "DPO", {"base": base("sft"), "policy_lora": lora, "export_dir": "dpo"},
          "PreferenceDataModule", data["pairs"], max_steps=2)
    exported = [tmp_path / "reward/reward", tmp_path / "ppo/policy", tmp_path / "ppo/critic", tmp_path / "grpo/policy",
                tmp_path / "dpo/policy"]
    for folder in exported:
        weights = load_file(folder / "adapter_model.safetensors")
        assert weights and all(torch.isfinite(w.float()).all() for w in weights.values()), folder
    trained = load_file(tmp_path / "ppo/policy/adapter_model.safetensors")
    assert any(("lora_B" in name) and w.abs().sum() > 0 for name, w in trained.items())  # PPO did train
