"""The embedded task: gold reward by hand, determinism, label noise, tokenizer."""

from __future__ import annotations

import pytest

from rlhf_lightning.tasks.synthetic import (
    SyntheticTask,
    _parse_sentence,
    _split_sentences,
    bradley_terry_temperature,
    build_tokenizer,
    gold_reward,
    gold_rewards,
)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("is good .", 1.0),
        ("is very good .", 1.5),  # intensified predicate
        ("is bad .", -1.0),
        ("is really bad .", -1.5),
        ("is big .", 0.0),
        ("likes the happy dog .", 1.0),
        ("likes the happy dog . the cat is happy .", 0.0),  # the repeated positive adjective costs 1
        ("is good and a cat is kind . my dog sees the lovely river .", 3.0),
        ("is good . a cat", -1.0),  # unfinished last sentence: -2
        ("good good good .", -2.0),  # not a sentence
        ("is good . is good .", -1.0),  # the second sentence lacks its subject
        ("", -2.0),
        ("is good . <eos> <pad>", 1.0),  # special tokens are ignored
    ],
)
def test_gold_reward_by_hand(response, expected):
    assert gold_reward("the cat", response) == pytest.approx(expected)


def test_gold_rewards_is_batched_gold_reward():
    assert gold_rewards(["a", "b"], ["is good .", "is bad ."]) == [1.0, -1.0]
    with pytest.raises(ValueError):
        gold_rewards(["a"], ["is good .", "is bad ."])


def test_rows_are_deterministic_from_the_seed_and_grammatical():
    first, again, other = SyntheticTask(seed=3), SyntheticTask(seed=3), SyntheticTask(seed=4)
    assert first.sft_rows(50) == again.sft_rows(50)
    assert first.sft_rows(50) != other.sft_rows(50)
    assert first.preference_rows(20) == again.preference_rows(20)
    # The generator only writes grammatical text: every sentence parses and is finished.
    rows = first.sft_rows(500)
    for row in rows:
        sentences = _split_sentences(row["completion"].split())
        assert all(finished for _, finished in sentences)
        assert all(_parse_sentence(words, index == 0) is not None for index, (words, _) in enumerate(sentences))
    # Responses fit PPO's 32 new tokens (words + EOS) but for a rare few.
    assert sum(len(r["completion"].split()) >= 32 for r in rows) / len(rows) < 0.01


def test_preference_labels_agree_with_gold_about_85_percent():
    rows = SyntheticTask(seed=0, label_accuracy=0.85).preference_rows(4000)
    agreement = sum(r["gold_chosen"] > r["gold_rejected"] for r in rows) / len(rows)
    assert 0.83 < agreement < 0.87
    assert all(r["gold_chosen"] != r["gold_rejected"] for r in rows)
    for row in rows[:50]:
        assert gold_reward(row["prompt"], row["chosen"]) == row["gold_chosen"]
        assert gold_reward(row["prompt"], row["rejected"]) == row["gold_rejected"]


def test_bradley_terry_temperature_solves_for_the_agreement():
    import math

    gaps = [0.5, 1.0, 1.0, 2.0, 3.5]
    temperature = bradley_terry_temperature(gaps, 0.8)
    agreement = sum(1 / (1 + math.exp(-g / temperature)) for g in gaps) / len(gaps)
    assert agreement == pytest.approx(0.8, abs=1e-6)
    with pytest.raises(ValueError, match="label_accuracy"):
        bradley_terry_temperature(gaps, 0.4)


def test_tokenizer_round_trip_and_special_tokens():
    tokenizer = build_tokenizer()
    ids = tokenizer("the cat is very good .")["input_ids"]
    assert tokenizer.decode(ids) == "the cat is very good ."
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.bos_token_id is None
    assert tokenizer.padding_side == "left"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True,
                                             tokenize=False)
    assert rendered == "<user> the cat <assistant>"
