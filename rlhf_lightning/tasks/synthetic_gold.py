"""The synthetic task's hidden gold reward (see :mod:`rlhf_lightning.tasks.synthetic`): a parser of the grammar that
scores the adjectives of each grammatical sentence and penalises every sentence that does not parse."""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_lightning.tasks.synthetic_grammar import (
    ADJECTIVES,
    ADVERBS,
    CONJUNCTIONS,
    COPULA,
    DETERMINERS,
    MAX_ADJECTIVES,
    NEGATIVE,
    NOUNS,
    POSITIVE,
    SPECIAL_TOKENS,
    STOP,
    VERBS,
)

INTENSIFIER_FACTOR = 1.5
UNGRAMMATICAL_PENALTY = 2.0


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
    """The hidden true quality of ``response`` as a continuation of ``prompt`` (see
    :mod:`rlhf_lightning.tasks.synthetic`).

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
