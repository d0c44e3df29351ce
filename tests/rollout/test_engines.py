"""The engine as a typed component: a new engine is one class, chosen by its class path like any component; the
training loop syncs it after every optimizer step; the old ``decoding`` and ``vllm`` arguments are refused in one
line naming the new form."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from rlhf_lightning.cli import main
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.engines import Engine, sampling_mode
from rlhf_lightning.rollout.settings import SamplingSettings
from tests.helpers.cli import grpo, one_line


class PlainSampling(Engine):
    """An engine of a user's own: every token from a full forward pass of the whole sequence (no KV cache) and
    ``torch.multinomial``; it records what the loop asked of it. The registered engines share no code with it."""

    calls: list[tuple] = []  # class-level: the CLI builds the instance

    def draw(self, model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        sequences, mask = input_ids.repeat_interleave(group, 0), attention_mask.repeat_interleave(group, 0)
        prompt_length, logprobs = sequences.shape[1], []
        with sampling_mode(model, role, input_ids.device):
            for _ in range(settings.max_new_tokens):
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = model.hf_model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits
                scores = torch.log_softmax(logits[:, -1].float() / settings.temperature, -1)
                token = torch.multinomial(scores.exp(), 1)
                logprobs.append(scores.gather(-1, token))
                sequences, mask = torch.cat([sequences, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
        PlainSampling.calls.append(("draw", role, input_ids.shape[0], group))
        return sequences[:, prompt_length:], torch.cat(logprobs, 1)

    def sync(self, model: SharedBase, role: str, version: int) -> None:
        PlainSampling.calls.append(("sync", role, version))


ENGINE = "--model.init_args.engine=tests.rollout.test_engines.PlainSampling"


def test_an_engine_of_ones_own_is_one_class_chosen_by_its_class_path_and_synced_after_every_step(
        tiny_model_dir, reward_dir, tmp_path, capsys):
    PlainSampling.calls.clear()
    main(grpo(tiny_model_dir, reward_dir, ENGINE, "--trainer.limit_train_batches=2", "--model.init_args.update.epochs=2",
              "--model.init_args.update.num_minibatches=2", "--model.init_args.update.target_kl=null",
              f"--trainer.default_root_dir={tmp_path}"))
    draws = [call for call in PlainSampling.calls if call[0] == "draw"]
    syncs = [call for call in PlainSampling.calls if call[0] == "sync"]
    assert [call[1] for call in draws] == ["policy", "policy"]  # one rollout an iteration, from the policy
    # after every optimizer step (2 iterations x 2 epochs x 2 minibatches), numbered by the steps taken so far
    assert syncs == [("sync", "policy", version) for version in range(1, 9)]
    # the sync of an iteration's last step comes before the next iteration's rollout
    assert [call[0] for call in PlainSampling.calls] == ["draw", *["sync"] * 4, "draw", *["sync"] * 4]


def test_the_config_shows_the_engine_as_a_component_with_its_class_path(tiny_model_dir, reward_dir, capsys):
    with contextlib.suppress(SystemExit):
        main(grpo(tiny_model_dir, reward_dir, ENGINE, "--print_config"))
    printed = capsys.readouterr().out
    assert "    engine:\n      class_path: tests.rollout.test_engines.PlainSampling\n" in printed
    with contextlib.suppress(SystemExit):
        main(grpo(tiny_model_dir, reward_dir, "--print_config"))
    assert "    engine:\n      class_path: rlhf_lightning.rollout.engines.Auto\n" in capsys.readouterr().out


def test_the_old_decoding_and_vllm_arguments_are_refused_in_one_line_naming_the_engine(
        tiny_model_dir, reward_dir, capsys):
    line = one_line(capsys, *grpo(tiny_model_dir, reward_dir, "--model.init_args.decoding=eager"), code=2)
    assert "decoding" in line and "engine: {class_path: rlhf_lightning.rollout.engines.EagerDecoder}" in line
    line = one_line(capsys, *grpo(tiny_model_dir, reward_dir, "--model.init_args.vllm={kv_cache_gib: 1}"), code=2)
    assert "rlhf_lightning.rollout.vllm_engine.VLLMEngine" in line


def test_an_engine_that_refuses_the_run_stops_it_at_setup_in_one_line(tiny_model_dir, reward_dir, capsys):
    line = one_line(capsys, *grpo(tiny_model_dir, reward_dir, "--model.init_args.sampling.kv_cache=dynamic",
                                  "--model.init_args.engine=rlhf_lightning.rollout.engines.CompiledDecoder"))
    assert line == ("error: engine CompiledDecoder decodes over a static KV cache; kv_cache: dynamic needs the "
                    "engine Generate (or Auto)")
