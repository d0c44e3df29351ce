"""Multi-turn episodes on the shared base: the transcript is the generated tokens plus the environment's, the
policy's log-probs from one pass equal those each turn was sampled under, environment tokens carry nothing, and
every online algorithm trains on episodes (and resumes exactly)."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_lightning import GRPO, PPO, RLOO, REINFORCEPlusPlus
from rlhf_lightning.algorithms import token_rewards
from rlhf_lightning.algorithms.advantages import _gae_loop, gae
from rlhf_lightning.algorithms.group import returns_to_go
from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.rollout.engines import EagerDecoder
from rlhf_lightning.rollout.episodes import opening_ids
from rlhf_lightning.rollout.rollouts import Rollouts
from rlhf_lightning.rollout.sampler import Sampler
from rlhf_lightning.rollout.seeds import Seeds
from rlhf_lightning.rollout.settings import SamplingSettings
from rlhf_lightning.tasks.calculator import build_tokenizer, correct_answer
from tests.helpers.cli import REPO, cli_subprocess
from tests.helpers.episodes import Feedback, calculator_batch, episodic
from tests.helpers.online import fit_iterations, prompts


def sample_episodes(module, prompts, per_prompt):
    """``per_prompt`` episodes per prompt, as a training rollout samples them."""
    with module.policy.sampler.gathered_base(module.model):
        return module.policy.rollouts.run(module.model, POLICY, prompts, per_prompt, "test")


def turns_of(episode):
    """``[(start, end)]`` of each policy segment of an episode's tokens."""
    segments, start = [], None
    for position, flag in enumerate([*episode.policy, False]):
        if flag and start is None:
            start = position
        elif not flag and start is not None:
            segments.append((start, position))
            start = None
    return segments


def test_episodes_interleave_policy_and_environment_tokens(calculator_model_dir):
    module = episodic(GRPO, calculator_model_dir)
    torch.manual_seed(1)
    batch = sample_episodes(module, calculator_batch(module), 2)
    delta = module.policy.rollouts.delta([{"role": "user", "content": "try again"}])
    answered = 0
    for row, episode in enumerate(batch.episodes):
        # every policy turn but the last is followed by exactly the environment's delta, then the next turn
        for _, end in turns_of(episode)[:-1]:
            assert episode.tokens[end - 1] in module.policy.sampler.settings.stop_token_ids
            assert episode.tokens[end:end + len(delta)] == delta and episode.policy[end + len(delta)]
            answered += 1
        assert episode.turns <= 3 and len(episode.tokens) <= 40
        mask = batch.response_mask[row]
        width = len(episode.tokens)
        assert mask[:width].tolist() == episode.policy and not mask[width:].any()
        # each turn's reward sits at the turn's last policy token
        rewards = batch.turn_rewards[row]
        assert rewards.nonzero().flatten().tolist() == [position for position, _ in episode.rewards]
        assert torch.allclose(rewards.sum(), torch.tensor(0.25 * len(episode.rewards)))
    assert answered > 0


def test_one_pass_log_probs_equal_what_each_turn_was_sampled_under(calculator_model_dir):
    module = episodic(GRPO, calculator_model_dir)
    torch.manual_seed(2)
    batch = sample_episodes(module, calculator_batch(module), 2)
    with torch.no_grad():
        one_pass, _ = module.policy.response_logprobs(POLICY, batch.input_ids, batch.attention_mask, batch.response_mask)
        checked = 0
        for row, episode in enumerate(batch.episodes):
            for start, end in turns_of(episode):
                # The context this turn was sampled after, alone and unpadded: opening + everything before it.
                context = torch.tensor([episode.opening + episode.tokens[:end]])
                per_turn, _ = module.policy.token_logprobs(POLICY, context, torch.ones_like(context),
                                                    torch.arange(context.shape[1])[None] >= len(episode.opening) + start)
                torch.testing.assert_close(one_pass[row, start:end], per_turn[0, -(end - start):], atol=1e-5, rtol=1e-5)
                checked += end - start
    assert checked == int(batch.response_mask.sum()) and checked > 0


def test_the_transcript_is_the_sampled_tokens_never_a_retokenization(calculator_model_dir):
    tokenizer = build_tokenizer()
    # Why it matters: '"', 'a', '"' sampled one by one decode to '"a"', which encodes as one other token.
    sampled = tokenizer.convert_tokens_to_ids(['"', "a", '"'])
    assert tokenizer(tokenizer.decode(sampled), add_special_tokens=False)["input_ids"] != sampled
    module = episodic(GRPO, calculator_model_dir)
    rows = calculator_batch(module)
    torch.manual_seed(3)
    state = torch.random.get_rng_state()
    batch = sample_episodes(module, rows, 1)
    # The first turn again, by the sampler itself, from the same random state: the same tokens.
    torch.random.set_rng_state(state)
    openings = [opening_ids(tokenizer, [{"role": "user", "content": p}], None) for p in rows["prompt"]]
    width = max(map(len, openings))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(o)) + o for o in openings])
    first_turn = module.policy.sampler.draw(module.model, POLICY, ids, (ids != tokenizer.pad_token_id).long(),
                                     max_new_tokens=6)
    for row, episode in enumerate(batch.episodes):
        start, end = turns_of(episode)[0]
        assert episode.opening == openings[row]
        assert episode.tokens[start:end] == first_turn.tokens[row][first_turn.mask[row]].tolist()


def test_masks_with_holes_skip_environment_tokens_in_rewards_gae_and_returns():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 0, 0]]).bool()
    rewards, values = torch.randn(2, 7), torch.randn(2, 7)
    advantages, returns = gae(rewards, values, mask, 0.9, 0.8)
    go = returns_to_go(rewards, mask, 0.5)
    for row in range(2):
        policy = mask[row].nonzero().flatten()
        dense = torch.ones(1, len(policy), dtype=torch.bool)
        expected_advantages, expected_returns = _gae_loop(rewards[row, policy][None], values[row, policy][None], dense,
                                                          0.9, 0.8)
        torch.testing.assert_close(advantages[row, policy], expected_advantages[0])
        torch.testing.assert_close(returns[row, policy], expected_returns[0])
        torch.testing.assert_close(go[row, policy], returns_to_go(rewards[row, policy][None], dense, 0.5)[0])
        assert advantages[row, ~mask[row]].eq(0).all() and go[row, ~mask[row]].eq(0).all()
    shaped = token_rewards(torch.tensor([1.0, 2.0]), torch.zeros(2, 7), mask, 0.1)
    assert shaped.nonzero().tolist() == [[0, 5], [1, 2]]  # the score at the last policy token, not at sum - 1


@pytest.mark.parametrize("algorithm", [GRPO, RLOO, REINFORCEPlusPlus, PPO])
def test_every_online_algorithm_trains_on_episodes(algorithm, calculator_model_dir):
    extra = {"kl": {"coef": 0.1}} if algorithm is not PPO else {}
    module = episodic(algorithm, calculator_model_dir, **extra)
    module.trainer = None
    torch.manual_seed(4)
    experience, stats = module.collect_and_prepare(calculator_batch(module))
    mask = experience.response_mask
    episode_tokens = experience.attention_mask[:, -mask.shape[1]:].bool()
    assert (episode_tokens & ~mask).any()  # environment tokens sit between the policy's
    assert experience.advantages[~mask].eq(0).all() and experience.advantages[mask].ne(0).any()
    # the environment's 0.25 per answered turn: at the ends of the turns, and in every response's total
    turn_rewards = experience.turn_rewards.sum(-1)
    assert turn_rewards.gt(0).any() and torch.equal(turn_rewards % 0.25, torch.zeros_like(turn_rewards))
    rewards, _ = module.shape_rewards(experience)
    torch.testing.assert_close(rewards.total_scores, experience.scores + turn_rewards)
    for name in ("episode/turns", "episode/policy_tokens", "episode/env_tokens", "episode/tool_calls",
                 "episode/env_reward"):
        assert name in stats
    assert stats["episode/turns"] > 1.0  # Feedback never ends an episode: only episodes.max_turns or max_tokens do
    # the completions table shows whole transcripts, the environment's parts marked
    assert any("[[user try again" in text for text in module.last_samples.responses)
    losses = module.losses(experience)
    losses["loss/total"].backward()
    trained = {name for name, p in module.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    adapters = {"policy", "critic"} if algorithm is PPO else {"policy"}
    assert trained and all(any(f".{a}." in name for a in adapters) or "heads.value" in name for name in trained)


def test_a_grpo_run_on_episodes_resumes_exactly(calculator_model_dir, tmp_path):
    def module():
        return episodic(GRPO, calculator_model_dir, kl={"coef": 0.1}, update={"num_minibatches": 2})

    first = module()
    _, whole = fit_iterations(first, prompts(first, n=8, dataset="calculator", batch_size=2), tmp_path / "whole", 4,
                    prefix="grpo/")
    checkpoint = tmp_path / "whole" / "epoch=0-step=4.ckpt"  # after iteration 2 of 4 (2 optimizer steps each)
    second = module()
    _, resumed = fit_iterations(second, prompts(second, n=8, dataset="calculator", batch_size=2), tmp_path / "resumed", 4,
                      prefix="grpo/", ckpt_path=str(checkpoint))
    # Every value is bit-identical but the sampler-trainer mismatch, float noise (~1e-7 nats) that MKL's kernels
    # vary with memory alignment from one process state to another.
    noise = [key for key in whole[0] if "mismatch" in key]
    assert len(resumed) == 2 and [{k: v for k, v in row.items() if k not in noise} for row in resumed] == [
        {k: v for k, v in row.items() if k not in noise} for row in whole[2:]]
    for before, after in zip(whole[2:], resumed, strict=True):
        assert all(abs(before[key] - after[key]) < 1e-6 for key in noise)
    assert {"grpo/episode/turns", "grpo/episode/env_tokens"} <= set(whole[0])
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["hyper_parameters"]
    assert saved["episodes"] == {"max_turns": 3, "max_tokens": 40} and "environment" not in saved  # the bounds only


def test_the_hyper_parameters_keep_the_episode_bounds_but_not_the_environment(calculator_model_dir):
    """The environment is code (a factory, named by the config's ``class_path``): ``hparams["episodes"]`` holds the
    bounds, from Python and from a config, and the policy's turn loop runs ``episodes.environment``."""
    from rlhf_lightning.cli import RLHFCLI
    from rlhf_lightning.environments import ToolEnvironment

    module = episodic(GRPO, calculator_model_dir, episodes={"max_turns": 2})
    assert module.hparams["episodes"] == {"max_turns": 2, "max_tokens": 40}
    assert "environment" not in module.hparams and module.episodes.environment is Feedback
    assert module.policy.rollouts.environment is Feedback
    cli = RLHFCLI(args=["--config", str(REPO / "configs" / "calculator_grpo.yaml"), "--trainer.logger=false",
                        f"--model.init_args.base.name_or_path={calculator_model_dir}",
                        "--model.init_args.episodes.max_turns=2"], run=False)
    assert cli.model.hparams["episodes"] == {"max_turns": 2, "max_tokens": 96}  # the config's budget kept
    assert "environment" not in cli.model.hparams
    assert isinstance(cli.model.episodes.environment(), ToolEnvironment)  # the config's environment, made anew per episode


def test_episodes_whose_turns_could_pass_the_model_positions_are_refused_before_training(calculator_model_dir):
    # The calculator's longest prompt is 19 tokens, its opening 25 (the template's markers); n_positions is 160.
    module = episodic(GRPO, calculator_model_dir, episodes={"max_tokens": 141, "max_turns": 40},
                      sampling={"max_new_tokens": 12}, samples_per_prompt=4)
    data = prompts(module, n=8, dataset="calculator", batch_size=8)
    assert data.longest() + 141 == 160  # what the check once counted: it passed, and a late turn crashed
    with pytest.raises(ValueError) as error:
        module.check_lengths(data)
    assert str(error.value) == (
        "the longest prompt's opening (25 tokens) and an episode of 141 tokens (a turn can start after 140 of them "
        f"and decode 12 more: sampling.max_new_tokens) reach 177 positions, beyond the 160 of model "
        f"{calculator_model_dir} (n_positions), whose learned position embeddings stop there; lower episodes.max_tokens "
        "(null = episodes.max_turns x sampling.max_new_tokens), sampling.max_new_tokens or data.init_args.max_length")
    # The largest budget it accepts (25 + 123 + 12 = 160) runs episodes that never end to their budget.
    module = episodic(GRPO, calculator_model_dir, sampling={"max_new_tokens": 12},
                      episodes={"environment": Feedback, "max_tokens": 124, "max_turns": 40})
    module.check_lengths(data)
    torch.manual_seed(0)
    batch = sample_episodes(module, calculator_batch(module, 2), 2)
    assert len(batch.episodes) == 4
    assert all(episode.truncated and len(episode.tokens) <= 124 for episode in batch.episodes)


def test_a_sum_written_with_thousands_separators_is_read_as_the_number():
    prompt = ["what is 70000 + 84616 ?"] * 4
    completions = ["answer 154616", "answer 154,616", "answer 154", "answer 154,6160"]
    assert correct_answer(prompt, completions, answer=["154,616"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert correct_answer(prompt, completions, answer=[154616.0] * 4) == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.slow
def test_an_answer_that_is_no_number_stops_the_fit_at_setup_naming_file_row_and_column(calculator_model_dir,
                                                                                        tmp_path):
    rows = [{"prompt": "what is 48213 + 90377 ?", "answer": 138590},
            {"prompt": "what is 70000 + 84616 ?", "answer": "154,616"},
            {"prompt": "what is 70000 + 84616 ?", "answer": "about 154 thousand"}]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = cli_subprocess(
        tmp_path, "fit", "--config", str(REPO / "configs" / "calculator_grpo.yaml"),
        f"--model.init_args.base.name_or_path={calculator_model_dir}", "--data.init_args.dataset=sums.jsonl",
        "--data.init_args.val_fraction=0", "--trainer.logger=false", "--trainer.callbacks=[]")
    assert result.returncode == 1, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: sums.jsonl line 3: column 'answer': expected a whole number such as 154616 or 154,616, got "
        "'about 154 thousand' (read by reward function rlhf_lightning.tasks.calculator.correct_answer)"]
    assert "Traceback" not in result.stderr and "rollout" not in result.stderr


def test_the_turn_loop_with_another_sampler_reuses_what_the_environments_probe_read():
    """Each rollout drawn ahead runs the producer's turn loop with the sampler of its job's policy version: the
    environment is not made and probed again for every job."""
    made = []

    class Counted(Feedback):
        def __init__(self) -> None:
            made.append(self)
            super().__init__()

    tokenizer = build_tokenizer()
    sampler = Sampler(SamplingSettings(max_new_tokens=6), Seeds(0), tokenizer.pad_token_id)
    rollouts = Rollouts(sampler, tokenizer, Counted, 3)
    assert len(made) == 1  # the probe that read the template's turn delimiters
    other_sampler = Sampler(SamplingSettings(max_new_tokens=6), Seeds(0), tokenizer.pad_token_id, engine=EagerDecoder())
    other = rollouts.with_sampler(other_sampler)
    assert len(made) == 1 and other.sampler is other_sampler and rollouts.sampler is sampler
    assert other.delta is rollouts.delta and other.delta is not None
    assert (other.environment, other.max_turns, other.max_tokens) == (Counted, 3, 18)
