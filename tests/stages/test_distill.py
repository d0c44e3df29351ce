"""On-policy distillation: each token's advantage is the teacher's log-prob minus the student's, on the student's
own samples; a teacher with another vocabulary, or a teacher adapter whose base was retrained in place, is refused
with one line; only the policy adapter trains."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_lightning import FunctionReward, OnPolicyDistillation
from rlhf_lightning.cli.merge_command import merge_adapter
from rlhf_lightning.models.fingerprint import BASE_RECORD, weights_fingerprint
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.tasks.synthetic import gold_rewards
from tests.helpers.families import FAMILIES, build_model_dir
from tests.helpers.models import (
    LORA,
    built,
    retrain_in_place,  # noqa: F401
)
from tests.helpers.online import first_batch, perturb, student


def test_the_advantage_of_a_token_is_the_teachers_log_prob_minus_the_students(tiny_model_dir, reward_dir):
    module = student(tiny_model_dir, reward_dir, teacher=tiny_model_dir)
    torch.manual_seed(0)
    same, stats = module.collect_and_prepare(first_batch(module))
    # A fresh adapter is the base itself: the teacher (the same base) agrees on every token.
    torch.testing.assert_close(same.advantages, torch.zeros_like(same.advantages), atol=1e-5, rtol=0)
    assert abs(float(stats["teacher/reverse_kl"])) < 1e-4

    perturb(module, "policy")
    torch.manual_seed(1)
    experience, stats = module.collect_and_prepare(first_batch(module))
    mask = experience.response_mask
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    width = mask.shape[1]
    for row in range(mask.shape[0]):
        keep = experience.attention_mask[row].bool()
        ids = experience.input_ids[row][keep]  # the row alone, unpadded: positions from 0
        with torch.no_grad():
            logits = teacher(ids[None]).logits[0, :-1]
        teacher_lp = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0][-int(mask[row].sum()):]
        student_lp, _ = module.policy.response_logprobs("policy", experience.input_ids[row:row + 1],
                                                 experience.attention_mask[row:row + 1], mask[row:row + 1])
        expected = teacher_lp - student_lp[0][mask[row]]
        torch.testing.assert_close(experience.advantages[row][mask[row]], expected, atol=1e-5, rtol=1e-5)
        assert experience.advantages[row][~mask[row]].eq(0).all()
    reverse_kl = -torch.where(mask, experience.advantages, 0.0).sum(-1).mean()
    torch.testing.assert_close(stats["teacher/reverse_kl"], reverse_kl)
    assert float(stats["teacher/reverse_kl"]) != 0.0 and width == experience.teacher_logprobs.shape[1]

    losses = module.losses(experience)
    losses["loss/total"].backward()
    trained = {name for name, p in module.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained and all(".policy." in name for name in trained)
    assert not any(p.requires_grad for p in module._teacher[0].parameters())
    assert not any("teacher" in key for key in module.state_dict())  # the teacher is not checkpointed


def test_a_teacher_with_another_vocabulary_is_refused_with_one_line(tiny_model_dir, reward_dir, tmp_path):
    other = build_model_dir(FAMILIES["qwen2"], tmp_path / "qwen2")
    with pytest.raises(ValueError, match="its tokenizer has another vocabulary") as error:
        student(tiny_model_dir, reward_dir, teacher=other)
    assert "\n" not in str(error.value) and str(other) in str(error.value)
    with pytest.raises(ValueError, match="neither adapter_config.json nor config.json there"):
        student(tiny_model_dir, reward_dir, teacher=tmp_path / "nowhere")


def test_a_teacher_adapter_on_the_same_base_grades_as_its_merged_model_does(tiny_model_dir, reward_dir, tmp_path):
    trained = student(tiny_model_dir, reward_dir, teacher=tiny_model_dir)
    perturb(trained, "policy")  # a policy away from the base: the teacher
    adapter = trained.export(tmp_path / "teacher")["policy"]
    merged = merge_adapter(adapter, tmp_path / "merged", str(tiny_model_dir))

    module = student(tiny_model_dir, reward_dir, teacher=adapter)
    assert module.teacher_is_adapter and not module._teacher  # no second model: a role on the shared base
    torch.manual_seed(0)
    experience, stats = module.collect_and_prepare(first_batch(module))
    mask = experience.response_mask
    teacher = AutoModelForCausalLM.from_pretrained(merged).eval()
    for row in range(mask.shape[0]):
        ids = experience.input_ids[row][experience.attention_mask[row].bool()]
        with torch.no_grad():
            logits = teacher(ids[None]).logits[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0][-int(mask[row].sum()):]
        torch.testing.assert_close(experience.teacher_logprobs[row][mask[row]], expected, atol=1e-5, rtol=1e-5)
    assert float(stats["teacher/reverse_kl"]) != 0.0
    module.losses(experience)["loss/total"].backward()
    reached = {name for name, p in module.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert reached and all(".policy." in name for name in reached)  # the teacher adapter stays frozen
    assert not any("teacher" in key for key in module.state_dict())  # and is not checkpointed


def test_a_teacher_adapter_whose_base_was_retrained_in_place_is_refused_by_its_fingerprint(tiny_model_dir, tmp_path,
                                                                                           caplog):
    def distill(base, teacher):
        return built(OnPolicyDistillation(base=BaseModelSpec(name_or_path=str(base)), policy_lora=LORA,
                                          sampling={"max_new_tokens": 6}, reward=FunctionReward(gold_rewards), teacher=str(teacher)))

    trained = distill(tiny_model_dir, teacher=tiny_model_dir)
    perturb(trained, "policy")
    teacher = trained.export(tmp_path / "grpo")["policy"]  # records the fingerprint of the base it was trained on
    base = tmp_path / "sft"  # the same weights in another folder
    shutil.copytree(tiny_model_dir, base)
    before = weights_fingerprint(str(base))
    assert (teacher / BASE_RECORD).is_file() and before == weights_fingerprint(str(tiny_model_dir))
    with caplog.at_level(logging.WARNING, logger="rlhf_lightning.models.adapter_fit"):
        assert distill(base, teacher).teacher_is_adapter
        assert not caplog.records  # same weights, other path: no warning (the path check alone warned here)
        retrain_in_place(base)
        after = weights_fingerprint(str(base))
        with pytest.raises(ValueError) as error:
            distill(base, teacher)
        assert str(error.value) == (
            f"the teacher adapter {teacher} was trained on other weights than base {base} holds now (its "
            f"{BASE_RECORD} says {before[:12]}, the base's files give {after[:12]}): the base was retrained or "
            "replaced since; train the teacher adapter again on this base, or load the base it was trained on (if "
            f"only the base's file format changed, delete {BASE_RECORD} there to compare paths only)")
        # An adapter exported before fingerprints were recorded keeps the path check: it warns and loads.
        (teacher / BASE_RECORD).unlink()
        distill(base, teacher)
    assert [r.getMessage() for r in caplog.records] == [
        f"the teacher adapter in {teacher} was trained on {tiny_model_dir}, but the base is {base}: they must hold "
        "the same weights"]
