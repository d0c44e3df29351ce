"""The embedded default task: a small synthetic language with a hidden, programmatic gold reward.

Everything is built on the fly from a seed, with no downloads, so a CPU laptop can run the whole
SFT -> reward model -> PPO pipeline and see real learning and real over-optimisation.

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

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
INTENSIFIER_FACTOR = 1.5
UNGRAMMATICAL_PENALTY = 2.0

# A chat template written in the task's own vocabulary, so conversational data works with its tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# --------------------------------------------------------------------------------------------------------
# Gold reward
# --------------------------------------------------------------------------------------------------------


def _parse_noun_phrase(words: Sequence[str], i: int) -> tuple[int, list[str]] | None:
    """Parse DET ADJ{0,3} NOUN at ``words[i:]``; return (next index, adjectives) or None."""
    if i >= len(words) or words[i] not in DETERMINERS:
        return None
    i += 1
    adjectives = []
    while i < len(words) and words[i] in ADJECTIVES and len(adjectives) < MAX_ADJECTIVES:
        adjectives.append(words[i])
        i += 1
    if i >= len(words) or words[i] not in NOUNS:
        return None
    return i + 1, adjectives


def _parse_predicate(words: Sequence[str], i: int) -> tuple[int, list[tuple[str, bool]]] | None:
    """Parse VERB NP | "is" [ADV] ADJ; return (next index, [(adjective, intensified)]) or None."""
    if i < len(words) and words[i] in VERBS:
        parsed = _parse_noun_phrase(words, i + 1)
        if parsed is None:
            return None
        end, adjectives = parsed
        return end, [(adjective, False) for adjective in adjectives]
    if i < len(words) and words[i] == COPULA:
        i += 1
        intensified = i < len(words) and words[i] in ADVERBS
        if intensified:
            i += 1
        if i >= len(words) or words[i] not in ADJECTIVES:
            return None
        return i + 1, [(words[i], intensified)]
    return None


def _parse_sentence(words: Sequence[str], subject_given: bool) -> list[tuple[str, bool]] | None:
    """Parse one sentence without its final ".": the adjectives it uses, or None if it is not grammatical."""
    adjectives: list[tuple[str, bool]] = []
    i = 0
    while True:
        if not subject_given:
            parsed_subject = _parse_noun_phrase(words, i)
            if parsed_subject is None:
                return None
            i, subject_adjectives = parsed_subject
            adjectives += [(adjective, False) for adjective in subject_adjectives]
        subject_given = False
        parsed_predicate = _parse_predicate(words, i)
        if parsed_predicate is None:
            return None
        i, predicate_adjectives = parsed_predicate
        adjectives += predicate_adjectives
        if i == len(words):
            return adjectives
        if words[i] not in CONJUNCTIONS:
            return None
        i += 1


def _split_sentences(words: Sequence[str]) -> list[tuple[list[str], bool]]:
    """Split at "." into (sentence words, finished) pairs; a trailing fragment is unfinished."""
    sentences, current = [], []
    for word in words:
        if word == STOP:
            sentences.append((current, True))
            current = []
        else:
            current.append(word)
    if current:
        sentences.append((current, False))
    return sentences


def gold_reward(prompt: str, response: str) -> float:
    """The hidden true quality of ``response`` as a continuation of ``prompt`` (see the module docstring).

    Special tokens in the text (``<eos>``, ``<pad>``) are ignored, so decoded responses can be passed as they are.
    """
    del prompt  # the prompt only supplies the first subject; quality is judged on the response
    words = [word for word in response.split() if word not in SPECIAL_TOKENS]
    sentences = _split_sentences(words)
    if not sentences:
        return -UNGRAMMATICAL_PENALTY
    score = 0.0
    used_positive: set[str] = set()
    for index, (sentence, finished) in enumerate(sentences):
        adjectives = _parse_sentence(sentence, subject_given=index == 0) if finished else None
        if adjectives is None:
            score -= UNGRAMMATICAL_PENALTY
            continue
        for adjective, intensified in adjectives:
            value = _adjective_value(adjective, used_positive)
            score += value * (INTENSIFIER_FACTOR if intensified else 1.0)
    return score


def _adjective_value(adjective: str, used_positive: set[str]) -> float:
    if adjective in POSITIVE:
        if adjective in used_positive:
            return -1.0
        used_positive.add(adjective)
        return 1.0
    if adjective in NEGATIVE:
        return -1.0
    return 0.0


def gold_rewards(prompts: Sequence[str], completions: Sequence[str], **_: object) -> list[float]:
    """Batched :func:`gold_reward`: ``gold_rewards(prompts, responses)``, or as a reward function with TRL's
    signature (``completions`` by keyword, other columns ignored)."""
    return [gold_reward(prompt, response) for prompt, response in zip(prompts, completions, strict=True)]


# --------------------------------------------------------------------------------------------------------
# Generator
# --------------------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class SyntheticTask:
    """The embedded task's data, deterministic from ``seed``.

    Args:
        seed: seed for every row generated.
        label_accuracy: fraction of preference labels that agree with the gold order (Bradley-Terry noise).
        corruption_prob: chance that a response of a preference pair has a slip (see
            :meth:`SyntheticLanguage.corrupt`), so that raters also compare broken text, as they do when rating
            samples of imperfect models.
        echo_prob: chance that a response of a preference pair repeats a positive adjective (see
            :meth:`SyntheticLanguage.echo`).
        language: the generator's probabilities.
    """

    seed: int = 0
    label_accuracy: float = 0.85
    corruption_prob: float = 0.25
    echo_prob: float = 0.1
    language: SyntheticLanguage = SyntheticLanguage()

    def _rng(self, stream: str) -> random.Random:
        # Separate streams so that, e.g., the prompts do not change when the corpus size does.
        return random.Random(f"{self.seed}:{stream}")

    def sft_rows(self, n: int) -> list[dict]:
        """``n`` prompt/completion demonstrations from the generator."""
        rng = self._rng("sft")
        rows = []
        for _ in range(n):
            prompt = self.language.prompt(rng)
            rows.append({"prompt": prompt, "completion": " " + self.language.response(rng)})
        return rows

    def prompt_rows(self, n: int) -> list[dict]:
        """``n`` prompts for RL (subjects for the policy to continue)."""
        rng = self._rng("prompts")
        return [{"prompt": self.language.prompt(rng)} for _ in range(n)]

    def preference_rows(self, n: int) -> list[dict]:
        """``n`` preference pairs labelled by Bradley-Terry sampling from the gold reward.

        Each row has ``prompt``, ``chosen``, ``rejected`` and the true scores ``gold_chosen`` and
        ``gold_rejected``. Pairs whose two responses have equal gold reward are not used: their gold order is
        undefined.
        """
        rng = self._rng("preferences")
        pairs = []
        while len(pairs) < n:
            prompt = self.language.prompt(rng)
            first, second = self._rated_response(rng), self._rated_response(rng)
            gold_first, gold_second = gold_reward(prompt, first), gold_reward(prompt, second)
            if gold_first != gold_second:
                pairs.append((prompt, first, second, gold_first, gold_second))
        temperature = bradley_terry_temperature(
            [abs(pair[3] - pair[4]) for pair in pairs], self.label_accuracy
        )
        rows = []
        for prompt, first, second, gold_first, gold_second in pairs:
            first_preferred = rng.random() < _sigmoid((gold_first - gold_second) / temperature)
            if not first_preferred:
                first, second, gold_first, gold_second = second, first, gold_second, gold_first
            rows.append(
                {
                    "prompt": prompt,
                    "chosen": " " + first,
                    "rejected": " " + second,
                    "gold_chosen": gold_first,
                    "gold_rejected": gold_second,
                }
            )
        return rows

    def _rated_response(self, rng: random.Random) -> str:
        response = self.language.response(rng)
        if rng.random() < self.echo_prob:
            response = self.language.echo(response, rng)
        return self.language.corrupt(response, rng) if rng.random() < self.corruption_prob else response


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def bradley_terry_temperature(gaps: Sequence[float], label_accuracy: float) -> float:
    """The temperature at which Bradley-Terry labels agree with the gold order ``label_accuracy`` of the time.

    Solves ``mean(sigmoid(gap / T)) = label_accuracy`` for T by bisection (the mean falls as T grows).
    """
    if not 0.5 < label_accuracy < 1.0:
        raise ValueError(f"label_accuracy must be in (0.5, 1), got {label_accuracy}")
    if not gaps or min(gaps) <= 0:
        raise ValueError("gaps must be a non-empty list of positive gold-score differences")

    def agreement(temperature: float) -> float:
        return sum(_sigmoid(gap / temperature) for gap in gaps) / len(gaps)

    low, high = 1e-3, 1e3
    for _ in range(100):
        mid = math.sqrt(low * high)
        if agreement(mid) > label_accuracy:
            low = mid
        else:
            high = mid
    return math.sqrt(low * high)


# --------------------------------------------------------------------------------------------------------
# Tokenizer and model
# --------------------------------------------------------------------------------------------------------


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


def write_dataset_files(out_dir: str | Path, seed: int = 0, sft: int = 2000, preferences: int = 2000,
                        prompts: int = 500) -> dict[str, Path]:
    """Write the task's data as JSONL files (``sft.jsonl``, ``preferences.jsonl``, ``prompts.jsonl``).

    Handy to look at the formats, or to train on the task with the file loaders instead of ``dataset: synthetic``.
    """
    import json

    task = SyntheticTask(seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "sft": (out / "sft.jsonl", task.sft_rows(sft)),
        "preferences": (out / "preferences.jsonl", task.preference_rows(preferences)),
        "prompts": (out / "prompts.jsonl", task.prompt_rows(prompts)),
    }
    for path, rows in files.values():
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {name: path for name, (path, _) in files.items()}
