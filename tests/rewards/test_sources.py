"""Reward sources: ``ModelReward``, a separate reward model with its own tokenizer and chat template, reading its
score where it was trained to (the turn-end token or EOS), with a pad token it may lack added and its embeddings
grown; a ``FunctionReward`` that returns bad scores is named with its row."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf_lightning.models.heads import ScalarHead
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rewards import FunctionReward, ModelReward, RewardInputs
from tests.helpers.families import FAMILIES, build_model_dir, build_tokenizer

CONVERSATIONS = [[{"role": "user", "content": "what is two plus three?"}],
                 [{"role": "system", "content": "be short."}, {"role": "user", "content": "hello there"}]]
COMPLETIONS = ["five.", "i am well, thank you, and how are you today?"]


@pytest.fixture(scope="module")
def policy_base(tiny_model_dir) -> tuple[SharedBase, object]:
    """The policy: the tiny GPT-2 with the synthetic word-level tokenizer, unlike either reward model's."""
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(spec)
    return SharedBase(load_causal_lm(spec, tokenizer)), tokenizer


def _inputs(prompts: list, completions: list[str]) -> RewardInputs:
    ids = torch.zeros(len(prompts), 3, dtype=torch.long)  # the policy's tokens: a reward model never reads them
    return RewardInputs(ids, torch.ones_like(ids), torch.full((len(prompts),), 2), prompts=prompts,
                        completions=completions, completion_ids=[[0]] * len(prompts))


def test_sequence_classifier_without_a_pad_token_reads_at_its_turn_end(policy_base, tmp_path):
    """A Llama-3-style classifier: no pad token (one is added and the embeddings grow), its own chat template on
    the original messages, scored at ``<|eot_id|>``: each row equals the classifier on that row alone."""
    family = FAMILIES["llama"]
    directory = build_model_dir(family, tmp_path / "base")
    torch.manual_seed(0)
    classifier = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=1)
    classifier.save_pretrained(tmp_path / "rm")
    build_tokenizer(family).save_pretrained(tmp_path / "rm")
    assert AutoTokenizer.from_pretrained(tmp_path / "rm").pad_token is None

    source = ModelReward(str(tmp_path / "rm"))
    source.setup(*policy_base)
    scores = source.score(_inputs(CONVERSATIONS, COMPLETIONS))

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "rm")
    turn_end = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    for row, (prompt, completion) in enumerate(zip(CONVERSATIONS, COMPLETIONS, strict=True)):
        ids = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": completion}],
                                            tokenize=True, return_dict=False)
        assert ids[-1] == turn_end and source.encode(prompt, completion, row) == list(ids)
        with torch.no_grad():
            expected = classifier(input_ids=torch.tensor([ids])).logits[0, 0]
        torch.testing.assert_close(scores[row], expected, atol=1e-5, rtol=1e-5)
    assert source.model.get_input_embeddings().num_embeddings == len(source.tokenizer) > len(tokenizer)


def test_reward_stage_folder_reads_at_the_chatml_turn_end_without_a_second_eos(policy_base, tmp_path):
    """A full fine-tuning export of the reward stage (causal LM + ``head.safetensors``) with a ChatML tokenizer:
    the score is read at ``<|im_end|>``, with neither the template's newline after it nor an appended EOS."""
    family = FAMILIES["qwen2"]
    directory = build_model_dir(family, tmp_path / "rm")
    torch.manual_seed(0)
    head = ScalarHead(32)
    torch.nn.init.normal_(head.linear.weight)
    head.save(directory)

    source = ModelReward(str(directory))
    source.setup(*policy_base)
    scores = source.score(_inputs(CONVERSATIONS, COMPLETIONS))

    tokenizer = AutoTokenizer.from_pretrained(directory)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = source.model
    for row, (prompt, completion) in enumerate(zip(CONVERSATIONS, COMPLETIONS, strict=True)):
        ids = source.encode(prompt, completion, row)
        rendered = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": completion}],
                                                 tokenize=True, return_dict=False)
        assert ids == list(rendered)[:-1] and ids[-1] == im_end  # the template's trailing newline dropped
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state
        torch.testing.assert_close(scores[row], head(hidden[0, -1]), atol=1e-5, rtol=1e-5)


def test_text_prompts_are_scored_as_text_closed_with_eos(policy_base, tmp_path):
    family = FAMILIES["opt"]
    directory = build_model_dir(family, tmp_path / "base")
    AutoModelForSequenceClassification.from_pretrained(directory, num_labels=1).save_pretrained(tmp_path / "rm")
    build_tokenizer(family).save_pretrained(tmp_path / "rm")
    source = ModelReward(str(tmp_path / "rm"), max_length=6)
    source.setup(*policy_base)
    ids = source.encode("question: what is two plus three? answer:", " five.", 0)
    tokenizer = source.tokenizer
    assert len(ids) == 6 and ids[-1] == tokenizer.eos_token_id  # cut from the left, the end kept
    scores = source.score(_inputs(["question: what is two plus three? answer:"] * 2, [" five.", " six."]))
    assert scores.shape == (2,) and torch.isfinite(scores).all() and scores[0] != scores[1]


def test_conversations_need_a_chat_template(policy_base, tmp_path):
    family = FAMILIES["opt"]  # no chat template
    directory = build_model_dir(family, tmp_path / "base")
    AutoModelForSequenceClassification.from_pretrained(directory, num_labels=1).save_pretrained(tmp_path / "rm")
    build_tokenizer(family).save_pretrained(tmp_path / "rm")
    source = ModelReward(str(tmp_path / "rm"))
    source.setup(*policy_base)
    with pytest.raises(Exception, match=r"reward model .*rm, row 0: conversational data needs a chat template"):
        source.score(_inputs(CONVERSATIONS[:1], COMPLETIONS[:1]))
    # ... which the source can be given
    with_template = ModelReward(str(tmp_path / "rm"), chat_template=FAMILIES["qwen2"].chat_template)
    with_template.setup(*policy_base)
    assert torch.isfinite(with_template.score(_inputs(CONVERSATIONS[:1], COMPLETIONS[:1]))).all()


def test_reward_functions_receive_the_original_messages_and_columns(policy_base):
    """``FunctionReward`` gets the prompt as the dataset holds it (messages, not rendered text) and every
    other column."""
    from rlhf_lightning.rewards import FunctionReward

    seen = {}

    def reward(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, answer=answer)
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    inputs = _inputs(CONVERSATIONS, ["five", "no"])
    inputs.columns["answer"] = ["five", "yes"]
    assert FunctionReward(reward).score(inputs).tolist() == [1.0, 0.0]
    assert seen["prompts"] == CONVERSATIONS and seen["answer"] == ["five", "yes"]


def test_an_adapter_path_one_folder_too_high_names_the_adapter_below(policy_base, reward_dir):
    """``outputs/reward`` for ``outputs/reward/adapters/reward``: the reward stage was run, so the line must not say
    to run it, but where the adapter is."""
    from rlhf_lightning.rewards import AdapterReward

    above = reward_dir.parent
    with pytest.raises(FileNotFoundError) as error:
        AdapterReward(str(above)).setup(*policy_base)
    assert str(error.value) == (f"reward adapter: {above}/adapter_config.json not found, but {reward_dir} holds one: "
                                "set reward.init_args.path to it")
    with pytest.raises(FileNotFoundError, match="run the reward stage first"):
        AdapterReward(str(above / "nothing-here")).setup(*policy_base)


@pytest.mark.parametrize(("returned", "error", "match"), [
    (["1.0", 2.0], TypeError, r"length_or_bad\b.*'1.0' \(str\) for row 0"),
    ([1.0, float("nan")], ValueError, r"returned nan for row 1"),
    ([1.0], ValueError, r"returned 1 scores for 2 completions"),
])
def test_a_bad_reward_function_is_named_with_its_row(returned, error, match):
    def length_or_bad(prompts, completions, **kwargs):
        return returned

    inputs = RewardInputs(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.tensor([2, 2]), ["a", "b"],
                          ["x", "y"], [[1], [2]])
    with pytest.raises(error, match=match):
        FunctionReward(length_or_bad).score(inputs)
