"""The embedded default task: a small synthetic language with a hidden, programmatic gold reward.

Everything is built on the fly from a seed, with no downloads, so a CPU laptop can run the whole
SFT -> reward model -> PPO pipeline and see real learning and real over-optimisation. This module is the task's name
(``dataset: synthetic``, ``tokenizer: synthetic``, ``rlhf_lightning.tasks.synthetic.gold_rewards``); its parts are
the language, its corpus writer and its tokenizer (``synthetic_grammar``), the gold reward (``synthetic_gold``) and
the rows and files of each stage (``synthetic_data``).

The language. A prompt is the subject of a sentence ("the happy cat"); a response finishes it and may go on::

    prompt:   the happy cat
    response: is very good and a robot likes the dull garden . the dog sees my river .

Grammar (one clause = subject + predicate; sentences end with "."; clauses are joined by "and"/"but")::

    sentence   := clause (CONJ clause)* "."
    clause     := noun_phrase predicate          (the first clause of a response has its subject in the prompt)
    noun_phrase:= DET ADJ{0,3} NOUN
    predicate  := VERB noun_phrase | "is" [ADV] ADJ

The gold reward (what a careful human rater would say) scores the response only:

* a positive adjective is worth +1 the first time it is used and -1 when it is repeated (raters dislike
  repetitive praise); a negative adjective is worth -1; neutral adjectives 0;
* an adverb before a predicate adjective ("is very good") multiplies that adjective's value by 1.5;
* every sentence that does not parse, including a last sentence left unfinished, costs 2 and earns nothing.

Preference labels come from the gold reward through Bradley-Terry sampling,
``P(a preferred to b) = sigmoid((gold(a) - gold(b)) / temperature)``, with the temperature calibrated so that
labels agree with the gold order ``label_accuracy`` (default 85 %) of the time, like human raters.
A proxy reward model trained on these pairs sees mostly grammatical, rarely repetitive text, so it never
learns the repetition and grammar penalties well: a policy that optimises it hard can drift to text that the
proxy loves and the gold reward does not, as in Gao et al. 2022.
"""

from __future__ import annotations

from rlhf_lightning.tasks.synthetic_data import SyntheticTask, bradley_terry_temperature, write_dataset_files
from rlhf_lightning.tasks.synthetic_gold import (
    INTENSIFIER_FACTOR,
    UNGRAMMATICAL_PENALTY,
    _parse_sentence,  # noqa: F401 (the parser's parts are tested here)
    _split_sentences,  # noqa: F401
    gold_reward,
    gold_rewards,
)
from rlhf_lightning.tasks.synthetic_grammar import (
    ADJECTIVES,
    ADVERBS,
    CHAT_TEMPLATE,
    CONJUNCTIONS,
    COPULA,
    CRITICISM_ADVERBS,
    DETERMINERS,
    EOS,
    MAX_ADJECTIVES,
    NEGATIVE,
    NEUTRAL,
    NOUNS,
    PAD,
    POSITIVE,
    PRAISE_ADVERBS,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    STOP,
    UNK,
    VERBS,
    VOCABULARY,
    WORDS,
    SyntheticLanguage,
    build_tokenizer,
)

__all__ = [
    "ADJECTIVES", "ADVERBS", "CHAT_TEMPLATE", "CONJUNCTIONS", "COPULA", "CRITICISM_ADVERBS", "DETERMINERS", "EOS",
    "INTENSIFIER_FACTOR", "MAX_ADJECTIVES", "NEGATIVE", "NEUTRAL", "NOUNS", "PAD", "POSITIVE", "PRAISE_ADVERBS",
    "ROLE_TOKENS", "SPECIAL_TOKENS", "STOP", "UNGRAMMATICAL_PENALTY", "UNK", "VERBS", "VOCABULARY", "WORDS",
    "SyntheticLanguage", "SyntheticTask", "bradley_terry_temperature", "build_tokenizer", "gold_reward",
    "gold_rewards", "write_dataset_files",
]
