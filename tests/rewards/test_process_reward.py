"""The process reward model as a reward source: where steps end in sampled responses, each step read as the PRM was
trained, the reductions, PPO's step rewards at their tokens (with another source's weighted score), GRPO on each
reduction, and the RL configs through the command line."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from rlhf_lightning import GRPO, PPO, FunctionReward, ProcessReward
from rlhf_lightning.algorithms import kl_penalty
from rlhf_lightning.cli import main
from rlhf_lightning.data.modules import PromptDataModule
from rlhf_lightning.data.tokenize import encode_steps
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rewards.inputs import reward_inputs
from rlhf_lightning.rewards.process_reward import PRM_ROLE, reduce_steps, step_ends
from rlhf_lightning.stages.process_reward_model import ProcessRewardModel
from rlhf_lightning.tasks.arithmetic import exact_match
from tests.helpers.cli import one_line
from tests.helpers.models import LORA, built
from tests.helpers.modules import merged

REPO = Path(__file__).resolve().parents[2]
SEP, EOS = 5, 1


@pytest.fixture(scope="module")
def prm_dir(tiny_arithmetic_dir, tmp_path_factory) -> Path:
    """A PRM with a random (non-zero) adapter update and head on the tiny arithmetic base, as the stage exports it."""
    torch.manual_seed(1)
    module = built(ProcessRewardModel(base=BaseModelSpec(name_or_path=str(tiny_arithmetic_dir)), lora=LORA,
                                      separator=","))
    with torch.no_grad():
        for name, parameter in module.model.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
        module.model.heads[PRM_ROLE].linear.weight.normal_(0, 1.0)
    return module.export(tmp_path_factory.mktemp("prm-adapters"))


def test_steps_end_at_separators_and_at_the_last_token_of_an_open_last_step():
    responses = torch.tensor([[7, 8, SEP, 9, 7, SEP, 8, EOS],   # two steps and a last one closed by EOS
                              [7, SEP, 8, SEP, EOS, 0, 0, 0],   # ends with a separator: no step after it
                              [7, 8, 9, 0, 0, 0, 0, 0],         # cut off, no separator: one step
                              [EOS, 0, 0, 0, 0, 0, 0, 0]])      # nothing but EOS: one (empty) step
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 3 + [0] * 5, [1] + [0] * 7]).bool()
    ends = step_ends(responses, mask, SEP, torch.tensor([EOS]))
    assert [row.nonzero().flatten().tolist() for row in ends] == [[2, 5, 7], [1, 3], [2], [0]]
    scores = torch.zeros(4, 8)
    scores[0, [2, 5, 7]] = torch.tensor([0.9, 0.2, 0.6])
    scores[1, [1, 3]] = torch.tensor([0.5, 0.8])
    scores[2, 2], scores[3, 0] = 0.3, 0.7
    expected = {"min": [0.2, 0.5, 0.3, 0.7], "prod": [0.9 * 0.2 * 0.6, 0.4, 0.3, 0.7],
                "mean": [1.7 / 3, 0.65, 0.3, 0.7], "last": [0.6, 0.8, 0.3, 0.7]}
    for reduction, values in expected.items():
        torch.testing.assert_close(reduce_steps(scores, ends, reduction), torch.tensor(values), msg=reduction)


def _module(cls, tiny_arithmetic_dir, reward, **kwargs):
    torch.manual_seed(0)
    defaults = dict(policy_lora=LORA, sampling={"max_new_tokens": 8}, samples_per_prompt=2,
                    update={"epochs": 1, "num_minibatches": 1}, optimizer={"lr": 1e-2}, gold_reward=exact_match)
    if cls is PPO:
        defaults["critic"] = {"lora": LORA}
    return built(cls(base=BaseModelSpec(name_or_path=str(tiny_arithmetic_dir)), reward=reward,
                     **merged(defaults, kwargs)))


def _prompts(module) -> dict:
    data = PromptDataModule(dataset="arithmetic", synthetic_rows=8, batch_size=8, val_fraction=0.0)
    data.tokenizer = module.tokenizer
    data.setup("fit")
    return next(iter(data.train_dataloader()["prompts"]))


def test_each_step_is_read_as_the_prm_was_trained(tiny_arithmetic_dir, prm_dir):
    module = _module(GRPO, tiny_arithmetic_dir, ProcessReward(str(prm_dir)))
    source, tokenizer = module.rewards.sources[0], module.tokenizer
    prompt = tokenizer("add 4 7 + 3 8")["input_ids"]
    responses = ["7 + 8 = 1 5 , 4 + 3 + 1 = 8 , answer 8 5 <eos>",  # closed by EOS: its last step read at a ","
                 "7 + 8 = 1 6 , 4 + 3",                              # cut off mid-step
                 "7 + 8 = 1 5 , <eos>"]                              # nothing after the last separator
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in responses]
    width = max(map(len, ids))
    input_ids = torch.tensor([prompt + row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids]).bool()
    attention = torch.cat([torch.ones(3, len(prompt), dtype=torch.long), mask.long()], 1)
    inputs = reward_inputs(input_ids, attention, mask, responses, ["add 4 7 + 3 8"] * 3, None, tokenizer)
    scores, ends = source.step_scores(inputs)

    comma = tokenizer.convert_tokens_to_ids(",")

    def as_trained(steps: list[str]) -> list[float]:
        """The PRM's probabilities at the separators of the stage's own encoding of ``steps``."""
        encoded = encode_steps(tokenizer, prompt, steps, [True] * len(steps), comma, "hand")
        sequence = torch.tensor([encoded.input_ids])
        with module.model.role(PRM_ROLE):
            logits = module.model.heads[PRM_ROLE](module.model.hidden_states(sequence, torch.ones_like(sequence)))
        return torch.sigmoid(logits[0, sequence[0] == comma]).tolist()

    expected = [(as_trained(["7 + 8 = 1 5", "4 + 3 + 1 = 8", "answer 8 5"]), [6, 14, 18]),
                (as_trained(["7 + 8 = 1 6", "4 + 3"]), [6, 9]),
                (as_trained(["7 + 8 = 1 5"]), [6])]
    for row, (values, positions) in enumerate(expected):
        assert ends[row].nonzero().flatten().tolist() == positions
        torch.testing.assert_close(scores[row, positions], torch.tensor(values))
        assert scores[row][~ends[row]].abs().sum() == 0  # nothing between the steps' ends
    torch.testing.assert_close(source.score(inputs), torch.tensor([min(values) for values, _ in expected]))

    # A batch whose responses hold no separator at all: each is one step, and the PRM says so
    plain = reward_inputs(input_ids[1:2, : len(prompt) + 4], attention[1:2, : len(prompt) + 4], mask[1:2, :4],
                          ["7 + 8 ="], ["add 4 7 + 3 8"], None, tokenizer)
    with pytest.warns(UserWarning, match=rf"no response of the batch contains the step separator \(token {comma}\)"):
        _, ends = source.step_scores(plain)
    assert ends[0].nonzero().flatten().tolist() == [3]


def test_ppo_trains_on_each_step_at_its_last_token_beside_a_weighted_checker(tiny_arithmetic_dir, prm_dir):
    reward = [ProcessReward(str(prm_dir)), FunctionReward(exact_match)]
    module = _module(PPO, tiny_arithmetic_dir, reward, reward_shaping={"weights": [0.5, 2.0]}, kl={"coef": 0.1})
    batch = _prompts(module)
    experience, _ = module.collect_and_prepare(batch)
    mask = experience.response_mask
    completions = module.policy.decode(experience.responses, mask)
    inputs = module.collector.reward_inputs(module, experience.input_ids, experience.attention_mask, mask,
                                            completions, [p for p in batch["prompt"] for _ in range(2)],
                                            {"answer": [a for a in batch["columns"]["answer"] for _ in range(2)]})
    step_scores, ends = module.rewards.sources[0].step_scores(inputs)
    assert ends.any(-1).all() and (ends.sum(-1) > 1).any()  # every response has a step, some several
    torch.testing.assert_close(experience.step_rewards, 0.5 * step_scores)
    checker = torch.tensor(exact_match(inputs.prompts, completions, answer=inputs.columns["answer"]))
    torch.testing.assert_close(experience.scores, 2.0 * checker)  # the PRM's reduction is not in the score
    shaped, _ = module.shape_rewards(experience)
    kl = torch.where(mask, kl_penalty(experience.logprobs, experience.ref_logprobs, "k1"), 0.0)
    expected = torch.where(mask, -0.1 * kl, 0.0) + 0.5 * step_scores
    last = mask.long().cumsum(-1).argmax(-1)
    expected[torch.arange(mask.shape[0]), last] += 2.0 * checker
    torch.testing.assert_close(shaped.token_rewards(), expected)


@pytest.mark.parametrize("reduction", ["min", "prod", "mean", "last"])
def test_grpo_trains_on_the_named_reduction_of_the_steps(tiny_arithmetic_dir, prm_dir, reduction):
    module = _module(GRPO, tiny_arithmetic_dir, ProcessReward(str(prm_dir), reduction))
    batch = _prompts(module)
    experience, _ = module.collect_and_prepare(batch)
    assert experience.step_rewards is None
    inputs = module.collector.reward_inputs(module, experience.input_ids, experience.attention_mask,
                                            experience.response_mask,
                                            module.policy.decode(experience.responses, experience.response_mask),
                                            [p for p in batch["prompt"] for _ in range(2)])
    step_scores, ends = module.rewards.sources[0].step_scores(inputs)
    by_hand = {"min": min, "prod": math.prod, "mean": lambda v: sum(v) / len(v), "last": lambda v: v[-1]}[reduction]
    expected = [by_hand(row[where].tolist()) for row, where in zip(step_scores, ends, strict=True)]
    torch.testing.assert_close(experience.scores, torch.tensor(expected))


def test_a_prm_with_an_environment_is_refused(tiny_arithmetic_dir, prm_dir):
    with pytest.raises(ValueError, match=r"^reward: ProcessReward scores the steps of single-turn responses, and "
                                         r"episodes\.environment is set; drop one of them$"):
        GRPO(base=BaseModelSpec(name_or_path=str(tiny_arithmetic_dir)), reward=ProcessReward(str(prm_dir)),
             episodes={"environment": lambda: None})


def rl_cli(config: str, tiny_arithmetic_dir, prm_dir, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / config),
            f"--model.init_args.base.name_or_path={tiny_arithmetic_dir}",
            f"--model.init_args.reward.init_args.path={prm_dir}", "--model.init_args.sampling.max_new_tokens=8",
            "--model.init_args.samples_per_prompt=2", "--data.init_args.synthetic_rows=20",
            "--data.init_args.batch_size=4", "--data.init_args.val_batch_size=8", "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=1", "--trainer.val_check_interval=1", "--trainer.callbacks=[]",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", *extra]


@pytest.mark.slow
def test_ppo_on_the_prm_runs_from_the_cli_and_logs_the_reduced_score(tiny_arithmetic_dir, prm_dir, tmp_path):
    """(GRPO's config is the same with another algorithm: its path is the API tests' above, and every config is
    parsed by tests/cli/test_command_line.py.)"""
    prefix = "ppo"
    main(rl_cli("arithmetic_ppo_prm.yaml", tiny_arithmetic_dir, prm_dir, "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                f"--trainer.logger.init_args.save_dir={tmp_path}", f"--model.init_args.export_dir={tmp_path / 'out'}"))
    with open(next(tmp_path.rglob("metrics.csv"))) as file:
        rows = list(csv.DictReader(file))
    scores = [float(row[f"{prefix}/val/score"]) for row in rows if row.get(f"{prefix}/val/score")]
    print(rows)
    assert len(scores) == 2 and all(0 < score < 1 for score in scores)  # the min of probabilities
    assert any(row.get(f"{prefix}/val/gold") for row in rows) and any(row.get(f"{prefix}/objective/score") for row in rows)
    assert (tmp_path / "out/policy/adapter_model.safetensors").exists()


def test_a_missing_prm_is_one_line(tiny_arithmetic_dir, tmp_path, capsys):
    line = one_line(capsys, *rl_cli("arithmetic_grpo_prm.yaml", tiny_arithmetic_dir, tmp_path / "nowhere",
                                    "--trainer.logger=false"))
    assert line == (f"error: process reward: {tmp_path / 'nowhere' / 'prm_config.json'} not found; run the PRM stage "
                    "first (python -m rlhf_lightning fit --config configs/arithmetic_prm.yaml) or set "
                    "reward.init_args.path to its adapters/prm folder")
