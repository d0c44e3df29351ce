"""The synthetic task's language (see :mod:`rlhf_lightning.tasks.synthetic`): its words, the writer of its corpus
(:class:`SyntheticLanguage`, the grammar with the probabilities of the "human demonstrations") and its word-level
tokenizer."""

from __future__ import annotations

import random
from dataclasses import dataclass

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
ROLE_TOKENS = ("<system>", "<user>", "<assistant>", "<tool>")
SPECIAL_TOKENS = (PAD, EOS, UNK, *ROLE_TOKENS)

DETERMINERS = ("the", "a", "my", "this", "every")
NOUNS = ("cat", "dog", "robot", "garden", "movie", "teacher", "river", "city", "song", "friend", "book", "storm")
VERBS = ("likes", "sees", "finds", "helps", "builds", "visits", "follows", "paints")
POSITIVE = ("good", "great", "happy", "bright", "kind", "lovely", "warm", "brilliant")
NEGATIVE = ("bad", "sad", "dull", "cold", "awful", "broken", "grim", "noisy")
NEUTRAL = ("big", "small", "old", "new", "red", "blue", "quiet", "tall")
# Writers intensify praise with "very"/"really" and criticism with "quite"/"rather": any adverb is grammatical
# before any adjective, but this habit of the corpus is what lets a language model tell praise from criticism.
PRAISE_ADVERBS = ("very", "really")
CRITICISM_ADVERBS = ("quite", "rather")
ADVERBS = PRAISE_ADVERBS + CRITICISM_ADVERBS
CONJUNCTIONS = ("and", "but")
COPULA = "is"
STOP = "."

ADJECTIVES = POSITIVE + NEGATIVE + NEUTRAL
WORDS = DETERMINERS + NOUNS + VERBS + ADJECTIVES + ADVERBS + CONJUNCTIONS + (COPULA, STOP)
VOCABULARY = SPECIAL_TOKENS + WORDS

MAX_ADJECTIVES = 3  # in one noun phrase

# A chat template written in the task's own vocabulary, so conversational data works with its tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@dataclass(frozen=True)
class SyntheticLanguage:
    """Probabilities of the generator that writes the corpus (the "human demonstrations").

    Args:
        adjective_prob: chance that a noun phrase carries an adjective.
        extra_adjective_prob: chance of one more adjective in a noun phrase, applied up to 3 adjectives.
        positive_share: chance that an adjective is a positive one (demonstrators are mostly neutral).
        negative_share: chance that an adjective is a negative one; the rest are neutral.
        copula_prob: chance that a predicate is "is [ADV] ADJ" rather than "VERB noun_phrase".
        adverb_prob: chance of an adverb before a positive or negative adjective in an "is ADJ" predicate.
        extra_clause_prob: chance of adding one more clause ("and ..."), applied up to ``max_clauses - 1`` times.
        extra_sentence_prob: chance of adding one more sentence, applied up to ``max_sentences - 1`` times.
        max_clauses: cap on clauses per sentence.
        max_sentences: cap on sentences per response (fewer than 1% of responses reach 32 tokens).
    """

    adjective_prob: float = 0.8
    extra_adjective_prob: float = 0.2
    positive_share: float = 0.15
    negative_share: float = 0.15
    copula_prob: float = 0.6
    adverb_prob: float = 0.4
    extra_clause_prob: float = 0.35
    extra_sentence_prob: float = 0.35
    max_clauses: int = 2
    max_sentences: int = 2

    def noun_phrase(self, rng: random.Random) -> list[str]:
        words = [rng.choice(DETERMINERS)]
        if rng.random() < self.adjective_prob:
            words.append(self.adjective(rng))
            while len(words) <= MAX_ADJECTIVES and rng.random() < self.extra_adjective_prob:
                words.append(self.adjective(rng))
        words.append(rng.choice(NOUNS))
        return words

    def adjective(self, rng: random.Random) -> str:
        draw = rng.random()
        if draw < self.positive_share:
            return rng.choice(POSITIVE)
        if draw < self.positive_share + self.negative_share:
            return rng.choice(NEGATIVE)
        return rng.choice(NEUTRAL)

    def predicate(self, rng: random.Random) -> list[str]:
        if rng.random() < self.copula_prob:
            adjective = self.adjective(rng)
            if adjective not in NEUTRAL and rng.random() < self.adverb_prob:
                return [COPULA, rng.choice(PRAISE_ADVERBS if adjective in POSITIVE else CRITICISM_ADVERBS), adjective]
            return [COPULA, adjective]
        return [rng.choice(VERBS), *self.noun_phrase(rng)]

    def sentence(self, rng: random.Random, subject_given: bool) -> list[str]:
        words = [] if subject_given else self.noun_phrase(rng)
        words += self.predicate(rng)
        for _ in range(self.max_clauses - 1):
            if rng.random() >= self.extra_clause_prob:
                break
            words += [rng.choice(CONJUNCTIONS), *self.noun_phrase(rng), *self.predicate(rng)]
        return [*words, STOP]

    def prompt(self, rng: random.Random) -> str:
        return " ".join(self.noun_phrase(rng))

    def response(self, rng: random.Random) -> str:
        words = self.sentence(rng, subject_given=True)
        sentences = 1
        while sentences < self.max_sentences and rng.random() < self.extra_sentence_prob:
            words += self.sentence(rng, subject_given=False)
            sentences += 1
        return " ".join(words)

    def corrupt(self, response: str, rng: random.Random) -> str:
        """One or two slips of a careless writer: a word dropped, a stray word inserted, a word stuttered, two
        words swapped, or the last sentence left unfinished."""
        words = response.split()
        for _ in range(rng.choice((1, 2))):
            slip = rng.randrange(5)
            position = rng.randrange(len(words))
            if slip == 0 and len(words) > 1:
                del words[position]
            elif slip == 1:
                words.insert(position, rng.choice(WORDS))
            elif slip == 2:
                words.insert(position, words[position])
            elif slip == 3 and position + 1 < len(words):
                words[position], words[position + 1] = words[position + 1], words[position]
            elif words[-1] == STOP:
                words.pop()
        return " ".join(words)

    def echo(self, response: str, rng: random.Random) -> str:
        """Repetitive praise: one positive adjective put in the first adjective slot and again in a later one
        (responses with fewer than two adjectives are returned unchanged)."""
        words = response.split()
        slots = [i for i, word in enumerate(words) if word in ADJECTIVES]
        if len(slots) < 2:
            return response
        praise = rng.choice(POSITIVE)
        first, later = slots[0], rng.choice(slots[1:])
        words[first] = words[later] = praise
        return " ".join(words)


def build_tokenizer():
    """A word-level tokenizer for the task's vocabulary, built locally (no download).

    It has a dedicated ``<pad>``, ``<eos>`` as end of sequence, no BOS, left padding (for generation) and a chat
    template written in the task's vocabulary.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = models.WordLevel({token: i for i, token in enumerate(VOCABULARY)}, unk_token=UNK)
    backend = Tokenizer(word_level)
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=128,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
