"""KTO: the loss number by number against the paper's formula and TRL 1.16's lines, the reference point from
mismatched rows of the same batch, TRL's unpaired data and paired data split into both, gradients reaching exactly
the policy adapter, and the shipped config from the command line logging every metric."""

from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlhf_lightning import KTO, UnpairedPreferenceDataModule
from rlhf_lightning.algorithms.kto import kto_loss, kto_reference_point, one_label_only, recommended_weights
from rlhf_lightning.cli import main
from rlhf_lightning.data.sources import DataFormatError, Record
from rlhf_lightning.models.shared_base import REFERENCE, adapter_of
from rlhf_lightning.stages.kto import EXAMPLE_METRICS
from rlhf_lightning.tasks import make_task
from rlhf_lightning.tasks.synthetic import gold_rewards
from tests.helpers.cli import logged_keys, one_line
from tests.helpers.modules import make
from tests.helpers.offline import perturb_policy

REPO = Path(__file__).resolve().parents[2]


def trl_kto_losses(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, kl_logps, ref_kl_logps,
                   beta, desirable_weight, undesirable_weight, loss_type):
    """TRL 1.16 ``KTOTrainer._compute_loss``'s lines (single process), transcribed."""
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    if loss_type == "kto":
        chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
        rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    else:  # apo_zero_unpaired
        chosen_losses = 1 - F.sigmoid(beta * chosen_logratios)
        rejected_losses = F.sigmoid(beta * rejected_logratios)
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return losses.nanmean(), kl, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33), (0.7, 1.0)])
def test_kto_loss_matches_trl_and_the_paper(loss_type, weights):
    torch.manual_seed(0)
    n = 12
    logps, ref_logps = -20 * torch.rand(n), -20 * torch.rand(n)
    kl_logps, ref_kl_logps = -20 * torch.rand(n), -22 * torch.rand(n)
    desirable = torch.rand(n) > 0.4
    assert 0 < desirable.sum() < n
    beta = 0.3
    z = kto_reference_point(kl_logps, ref_kl_logps)
    out = kto_loss(logps, ref_logps, desirable, z, beta, *weights, loss_type)
    expected, kl, chosen_rewards, rejected_rewards = trl_kto_losses(
        logps[desirable], logps[~desirable], ref_logps[desirable], ref_logps[~desirable], kl_logps, ref_kl_logps,
        beta, *weights, loss_type)
    torch.testing.assert_close(out.losses.mean(), expected, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(z, kl)
    torch.testing.assert_close(out.rewards[desirable], chosen_rewards)
    torch.testing.assert_close(out.rewards[~desirable], rejected_rewards)
    # The paper's eqn. 7 (value v(x, y) = lambda_y sigma(beta (r - z)) for desirable, sigma(beta (z - r)) otherwise;
    # loss lambda_y - v), element by element.
    for i in range(n):
        r, w = float(logps[i] - ref_logps[i]), weights[0] if desirable[i] else weights[1]
        zz = float(z) if loss_type == "kto" else 0.0
        value = 1 / (1 + math.exp(-beta * ((r - zz) if desirable[i] else (zz - r))))
        assert float(out.losses[i]) == pytest.approx(w - w * value, abs=1e-6)


def test_the_reference_point_is_a_clamped_detached_mean():
    mismatched = torch.tensor([-3.0, -1.0], requires_grad=True)
    assert float(kto_reference_point(mismatched, torch.tensor([-4.0, -4.0]))) == pytest.approx(2.0)
    assert float(kto_reference_point(mismatched, torch.tensor([0.0, 0.0]))) == 0.0  # a KL is never negative
    assert not kto_reference_point(mismatched, torch.tensor([-4.0, -4.0])).requires_grad


def test_trl_weight_advice():
    assert recommended_weights(100, 100, 1.0, 1.0) is None  # equal counts: TRL does not check
    assert recommended_weights(100, 90, 1.0, 1.0) is None  # ratio 1.11 is inside [1, 4/3]
    advice = recommended_weights(100, 300, 1.0, 1.0)  # TRL: desirable_weight in [3.0, 3.99]
    assert "desirable_weight in [3.00, 4.00]" in advice and "undesirable_weight in [0.25, 0.33]" in advice


def test_data_of_one_label_is_named_with_its_counts():
    assert one_label_only(3, 2, "kto.jsonl") is None and one_label_only(0, 0, "kto.jsonl") is None
    assert one_label_only(0, 7, "my/folder[train]") == (
        "all 7 training examples of my/folder[train] are undesirable (0 desirable): the loss can only lower their "
        "likelihood against the reference point, and nothing shows the policy what to prefer; kto/rewards/margin is "
        "never logged. Add desirable examples (label: true), or give preference pairs, which split into both")
    # TRL counts a missing label as 1 and advises weights for 36:1; ours says what is wrong instead
    assert recommended_weights(36, 0, 1.0, 1.0) is None


# ---------------------------------------------------------------------------------------------- data


def record(**fields) -> Record:
    return Record("data.jsonl line 7", fields)


def test_trl_unpaired_rows_and_pairs_split_into_both(tiny_model_dir):
    from rlhf_lightning.data.formats import parse_unpaired

    [example] = parse_unpaired(record(prompt="a b", completion=" c d", label=False))
    assert (example.prompt, example.completion, example.desirable) == ("a b", " c d", False)
    chosen, rejected = parse_unpaired(record(prompt="a", chosen=" b", rejected=" c", gold_chosen=1.0,
                                             gold_rejected=-1.0))
    assert (chosen.completion, chosen.desirable, chosen.gold) == (" b", True, 1.0)
    assert (rejected.completion, rejected.desirable, rejected.gold) == (" c", False, -1.0)
    with pytest.raises(DataFormatError, match=r"data.jsonl line 7: column 'label': expected true \(desirable\) or "
                                              r"false \(undesirable\), found str 'yes'"):
        parse_unpaired(record(prompt="a", completion=" b", label="yes"))
    with pytest.raises(DataFormatError, match="data.jsonl line 7: missing columns: expected prompt\\+completion\\+"
                                              "label .* found columns: completion, prompt"):
        parse_unpaired(record(prompt="a", completion=" b"))


def move_policy(module: KTO, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.model.model.named_parameters():
            if adapter_of(name) == "policy" and "lora_B" in name:
                parameter.normal_(0, 0.5)


make_kto = functools.partial(make, KTO, defaults=dict(sampling={"max_new_tokens": 4}, gold_reward=gold_rewards))


def examples(module: KTO, n: int = 16, batch_size: int = 8) -> UnpairedPreferenceDataModule:
    data = UnpairedPreferenceDataModule(dataset="synthetic", synthetic_rows=n, batch_size=batch_size,
                                        val_fraction=0.25, max_length=64)
    data.tokenizer = module.tokenizer
    data.setup("fit")
    return data


def test_a_batch_pairs_each_prompt_with_its_response_then_with_the_previous_ones(tiny_model_dir):
    module = make_kto(tiny_model_dir)
    data = examples(module)
    assert len(data.train_set) == 2 * 12 and data.label_counts() == (12, 12)  # 12 training pairs, split
    chosen = data.train_set[0]
    assert chosen.desirable and not data.train_set[1].desirable
    assert chosen.prompt_ids == data.train_set[1].prompt_ids and chosen.gold is not None
    batch = data.collate(data.train_set[:4])
    assert batch["input_ids"].shape[0] == 8 and batch["desirable"].tolist() == [e.desirable for e in data.train_set[:4]]
    for row in range(8):
        example = data.train_set[row % 4]
        response = data.train_set[(row % 4 - (row >= 4)) % 4].completion_ids
        ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        assert ids == example.prompt_ids + response
        assert batch["input_ids"][row][batch["response_mask"][row]].tolist() == response
    assert batch["gold"].tolist() == pytest.approx([e.gold for e in data.train_set[:4]])


def test_fresh_policy_loss_is_half_the_weight_and_values_match_an_independent_computation(tiny_model_dir):
    module = make_kto(tiny_model_dir, desirable_weight=1.0, undesirable_weight=1.5)
    batch = next(iter(examples(module).train_dataloader()))
    loss, values = module.batch_losses(batch, "train")
    weights = torch.where(batch["desirable"], 1.0, 1.5)
    assert float(loss) == pytest.approx(float(0.5 * weights.mean()), abs=1e-6)  # 1 - sigmoid(0) = 1/2
    assert float(values["reference_point"]) == 0.0

    def values_and_log_ratio():
        loss, values = module.batch_losses(batch, "train")
        with torch.no_grad():
            policy, reference = module.sequence_logps("policy", batch), module.sequence_logps(REFERENCE, batch)
        return loss, values, policy, reference, (policy[8:] - reference[8:]).mean()

    perturb_policy(module)  # a policy that lowers the mismatched rows' log-probs: z is clamped at 0
    *_, values, _, _, mean_log_ratio = values_and_log_ratio()
    assert float(mean_log_ratio) < 0 and float(values["reference_point"][0]) == 0.0
    move_policy(module, seed=0)  # one that raises them
    loss, values, policy, reference, mean_log_ratio = values_and_log_ratio()
    assert float(mean_log_ratio) > 0
    z = mean_log_ratio
    expected = kto_loss(policy[:8], reference[:8], batch["desirable"], z, 0.1, 1.0, 1.5)
    torch.testing.assert_close(values["reference_point"][0], z)
    torch.testing.assert_close(loss.detach(), expected.losses.mean())
    torch.testing.assert_close(values["rewards/chosen"], expected.rewards[batch["desirable"]])


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_gradients_reach_exactly_the_policy_adapter(tiny_model_dir, loss_type):
    module = make_kto(tiny_model_dir, loss_type=loss_type)
    perturb_policy(module)
    loss, _ = module.batch_losses(next(iter(examples(module).train_dataloader())), "train")
    loss.backward()
    policy = {name for name, _ in module.named_parameters() if adapter_of(name) == "policy"}
    reached = {name for name, p in module.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert policy and reached == policy


def cli_arguments(tiny_model_dir, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / "kto.yaml"), "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.log_every_n_steps=1", "--trainer.max_steps=3", "--trainer.val_check_interval=3",
            f"--model.init_args.base.name_or_path={tiny_model_dir}", "--model.init_args.policy_lora={r: 4, alpha: 8}",
            "--model.init_args.sampling.max_new_tokens=4", "--data.init_args.synthetic_rows=80",
            "--data.init_args.val_fraction=0.1", "--data.init_args.batch_size=8",
            "--data.init_args.val_batch_size=8", *extra]


def run_cli(tiny_model_dir, *extra: str) -> None:
    main(cli_arguments(tiny_model_dir, *extra))


def test_config_runs_from_the_cli_logs_every_metric_and_exports(tiny_model_dir, tmp_path):
    run_cli(tiny_model_dir)
    assert (tmp_path / "outputs/kto/adapters/policy/adapter_config.json").exists()
    train = {f"kto/{name}" for name in (*EXAMPLE_METRICS, "rewards/margin", "desirable_frac", "lr")}
    val = {f"kto/val/{name}" for name in (*EXAMPLE_METRICS, "gold", "kl", "length", "eos_frac")}
    missing = (train | val) - logged_keys(tmp_path / "outputs/kto", train | val)
    assert not missing, missing


def test_mistakes_are_one_line(tiny_model_dir, capsys, caplog):
    assert "a batch needs at least 2 examples" in one_line(
        capsys, *cli_arguments(tiny_model_dir, "--data.init_args.batch_size=1", "--trainer.logger=false"))
    assert "use rlhf_lightning.UnpairedPreferenceDataModule" in one_line(
        capsys, *cli_arguments(tiny_model_dir, "--data.class_path=rlhf_lightning.PreferenceDataModule",
                               "--trainer.logger=false"))
    assert "desirable_weight must be > 0" in one_line(
        capsys, *cli_arguments(tiny_model_dir, "--model.init_args.desirable_weight=0", "--trainer.logger=false"))
    # TRL's unpaired rows, three desirable responses for each undesirable one: the weights are advised.
    pairs = make_task("synthetic", 0).preference_rows(40)
    rows = [{"prompt": p["prompt"], "completion": p["chosen"], "label": True} for p in pairs[:30]]
    rows += [{"prompt": p["prompt"], "completion": p["rejected"], "label": False} for p in pairs[30:]]
    Path("kto.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with caplog.at_level(logging.WARNING, logger="rlhf_lightning.stages.kto"):
        run_cli(tiny_model_dir, "--data.init_args.dataset=kto.jsonl", "--trainer.max_steps=1",
                "--trainer.val_check_interval=1", "--trainer.logger=false")
    advice = [r.getMessage() for r in caplog.records if "outside the KTO paper" in r.getMessage()]
    assert len(advice) == 1 and "26 desirable and 10 undesirable" in advice[0]  # 4 of the 40 rows held out
    # TRL's bounds for these counts: desirable_weight in [round(10/26, 2), round(10/26 * 1.33, 2)], undesirable
    # in [round(26/10 / 1.33, 2), round(26/10, 2)]
    assert "desirable_weight in [0.38, 0.51] or undesirable_weight in [1.95, 2.60]" in advice[0]


def test_data_whose_labels_are_all_desirable_trains_with_a_warning_naming_the_file_and_counts(tiny_model_dir, caplog):
    pairs = make_task("synthetic", 0).preference_rows(40)
    rows = [{"prompt": p["prompt"], "completion": p["chosen"], "label": True} for p in pairs]
    Path("desirable.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with caplog.at_level(logging.WARNING, logger="rlhf_lightning.stages.kto"):
        run_cli(tiny_model_dir, "--data.init_args.dataset=desirable.jsonl", "--trainer.max_steps=1",
                "--trainer.limit_val_batches=0", "--trainer.logger=false")
    warnings = [r.getMessage() for r in caplog.records if r.name == "rlhf_lightning.stages.kto"]
    assert warnings == [  # 4 of the 40 rows held out for validation; no weight advice beside it
        "KTO: all 36 training examples of desirable.jsonl are desirable (0 undesirable): the loss can only raise "
        "their likelihood against the reference point, and nothing shows the policy what to avoid; "
        "kto/rewards/margin is never logged. Add undesirable examples (label: false), or give preference pairs, "
        "which split into both"]
    assert Path("outputs/kto/adapters/policy/adapter_config.json").exists()  # a warning: the fit ran to its export
