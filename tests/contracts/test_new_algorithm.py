"""docs/new-algorithm.md is real: its code adds GPG in under 60 lines (a hook and a registered loss), the advantages
are the paper's formula on a real rollout, and the page's command trains it from GRPO's config."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_lightning import AdapterReward
from rlhf_lightning.algorithms.policy_losses import PolicyLoss
from rlhf_lightning.cli import main
from rlhf_lightning.models.shared_base import adapter_of
from rlhf_lightning.models.spec import BaseModelSpec
from tests.helpers.cli import logged_keys
from tests.helpers.models import LORA, built
from tests.helpers.online import perturb, prompt_batch
from tests.helpers.user_code import user_module

REPO = Path(__file__).resolve().parents[2]
PAGE = (REPO / "docs" / "new-algorithm.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", PAGE, re.S | re.M)


@pytest.fixture
def my_gpg(tmp_path, monkeypatch):
    """The page's module, importable as ``my_gpg`` (as the page tells the reader to save it)."""
    with user_module(tmp_path, monkeypatch, "my_gpg", blocks("python")[0]) as my_gpg:
        yield my_gpg


def test_the_page_adds_an_algorithm_in_under_60_lines():
    code, command = blocks("python"), blocks("bash")
    lines = sum(len(block.splitlines()) for block in code + command)
    print(f"docs/new-algorithm.md: {lines} lines of code and command")
    assert len(code) == 1 and len(command) == 1 and lines < 60


def test_gpg_advantages_are_the_papers_rescaled_group_baseline(my_gpg, tiny_model_dir, reward_dir):
    torch.manual_seed(0)
    module = built(my_gpg.GPG(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), policy_lora=LORA,
                              reward=AdapterReward(str(reward_dir)), samples_per_prompt=4, sampling={"max_new_tokens": 6}))
    assert "VanillaPolicyGradient" in PolicyLoss.registry  # defining the class registered it
    perturb(module, "policy")
    experience, stats = module.collect_and_prepare(prompt_batch(module, n=4))
    # Two of the four groups are made to agree: their advantage is 0 and alpha = B / (B - M) = 16 / 8.
    scores = experience.scores.clone()
    scores[:4], scores[8:12] = 1.0, -0.5
    experience = type(experience)(**{**vars(experience), "scores": scores})
    rewards, _ = module.shape_rewards(experience)
    trained, stats = module.estimate_advantages(experience, rewards)
    grouped = scores.view(4, 4)
    expected = 2.0 * (grouped - grouped.mean(1, keepdim=True)).flatten()
    torch.testing.assert_close(trained.advantages, torch.where(experience.response_mask, expected[:, None], 0.0))
    assert float(stats["objective/alpha"]) == 2.0
    # the loss is -A log pi: its gradient reaches the policy adapter alone
    terms = module.losses(trained)
    policy = [p for name, p in module.named_parameters() if adapter_of(name) == "policy"]
    assert any(g.abs().sum() > 0 for g in torch.autograd.grad(terms["loss/policy"], policy))
    assert "policy/clipfrac" not in terms  # no clip, so nothing to count


def test_the_pages_command_trains_gpg_from_grpos_config(my_gpg, tiny_model_dir, reward_dir, tmp_path):
    command = blocks("bash")[0].replace("\\\n", " ").replace("configs/", f"{REPO}/configs/").split()
    assert command[:4] == ["python", "-m", "rlhf_lightning", "fit"]
    main([*command[3:], f"--model.init_args.base.name_or_path={tiny_model_dir}",
          f"--model.init_args.reward.init_args.path={reward_dir}", "--model.init_args.policy_lora={r: 4, alpha: 8}",
          "--model.init_args.sampling.max_new_tokens=4", "--data.init_args.synthetic_rows=40", "--data.init_args.batch_size=2",
          "--trainer.limit_train_batches=2", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
          "--trainer.enable_progress_bar=false"])
    expected = {"gpg/objective/alpha", "gpg/loss/policy", "gpg/objective/score", "gpg/val/gold"}
    missing = expected - logged_keys(tmp_path / "outputs/gpg", expected)
    assert not missing, missing
    assert (tmp_path / "outputs/gpg/adapters/policy/adapter_config.json").exists()


@pytest.mark.slow  # --model.help in a subprocess
def test_gpg_takes_no_loss_argument_and_documents_its_own(my_gpg, tmp_path):
    """The loss is fixed by the class: the command line neither offers nor accepts one."""
    help_text = subprocess.run([sys.executable, "-m", "rlhf_lightning", "fit", "--model.help", "my_gpg.GPG"],
                               capture_output=True, text=True, cwd=Path(my_gpg.__file__).parent, check=True).stdout
    assert "samples_per_prompt" in help_text and "GPG has none" in help_text
    assert "--model.init_args.policy_loss" not in help_text and "scale_rewards" not in help_text
