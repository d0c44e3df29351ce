"""The README's extension example is real code: it runs, and the CLI accepts it as a class_path."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlhf_lightning.cli import RLHFCLI
from tests.helpers.models import LORA
from tests.helpers.online import first_batch, make_ppo

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def readme_example(monkeypatch, tmp_path):
    """The example as a user has it: a file of their own on the path (the command line reads a class's source to
    follow its ``**kwargs`` to the arguments of the parts they reach, the policy's among them)."""
    text = (REPO / "README.md").read_text()
    code = re.search(r"```python\n(.*?class LengthPenalizedPPO.*?)```", text, re.S).group(1)
    (tmp_path / "readme_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "readme_example", raising=False)
    return importlib.import_module("readme_example")


def test_length_penalty_example_charges_every_response_token(readme_example, tiny_model_dir, reward_dir):
    torch.manual_seed(0)
    plain = make_ppo(tiny_model_dir, reward_dir)
    rollout, _ = plain.collect_and_prepare(first_batch(plain))
    penalized = readme_example.LengthPenalizedPPO(
        base=plain.hparams.base, reward=plain.rewards.sources[0], policy_lora=LORA, critic={"lora": LORA}, token_cost=0.25)
    expected, _ = plain.shape_rewards(rollout)
    rewards, _ = penalized.shape_rewards(rollout)
    mask = rollout.response_mask.float()
    torch.testing.assert_close(rewards.token_rewards(), expected.token_rewards() - 0.25 * mask)  # PPO's GAE reads these
    torch.testing.assert_close(rewards.sequence_rewards(), expected.sequence_rewards() - 0.25 * mask.sum(-1))
    torch.testing.assert_close(rewards.kl, expected.kl)
    assert rewards.kl_coef == expected.kl_coef > 0


def test_the_cli_accepts_the_subclass_with_its_new_argument(readme_example, tiny_model_dir, reward_dir):
    cli = RLHFCLI(args=[
        "--config", str(REPO / "configs" / "ppo.yaml"),
        "--model.class_path=readme_example.LengthPenalizedPPO", "--model.init_args.token_cost=0.02",
        f"--model.init_args.base.name_or_path={tiny_model_dir}",
        f"--model.init_args.reward.init_args.path={reward_dir}",
        "--model.init_args.policy_lora={r: 4, alpha: 8}", "--model.init_args.critic.lora={r: 4, alpha: 8}",
        "--trainer.logger=false",
    ], run=False)
    assert type(cli.model).__name__ == "LengthPenalizedPPO"
    assert cli.model.token_cost == 0.02
    config = yaml.safe_load((REPO / "configs" / "ppo.yaml").read_text())["model"]["init_args"]
    # the config's other arguments still apply
    assert cli.model.hparams["kl"]["coef"] == cli.model.kl.coef == config["kl"]["coef"]
