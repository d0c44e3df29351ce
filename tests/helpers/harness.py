"""Local lm-evaluation-harness tasks on the synthetic language's words (JSON files and task YAMLs: nothing from the
hub), and an adapter trained to answer them, for the evaluation tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from tests.helpers.models import LORA, tiny_spec

# A sentence's beginning and the noun that ends it: the generation task asks for the noun, the multiple-choice task
# offers it among two others.
NOUN_ENDINGS = [
    ("the cat sees a", "dog"), ("my teacher likes the", "garden"), ("a robot builds the", "city"),
    ("the river visits a", "song"), ("every friend paints the", "movie"), ("this storm follows a", "book"),
    ("the dog helps my", "teacher"), ("a song finds the", "river"), ("my city likes a", "robot"),
    ("the book sees every", "storm"),
]
OTHER_NOUNS = ("cat", "friend")

GENERATE_TASK = """task: tiny_nouns_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: " "
generation_kwargs:
  until: ["."]
  max_gen_toks: 3
  do_sample: false
filter_list:
  - name: first-word
    filter:
      - function: regex
        regex_pattern: '(\\w+)'
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

CHOICE_TASK = """task: tiny_nouns_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


ROLLING_TASK = """task: tiny_nouns_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


def write_tasks(folder: Path) -> tuple[Path, Path, Path]:
    """``(generate_until task YAML, multiple-choice task YAML, perplexity task YAML)`` in ``folder``, each on a
    JSONL file beside it (its absolute path in the YAML). The multiple-choice answer is the first choice on odd rows,
    the last on even ones; the perplexity task's texts are two sentences each (a dozen tokens)."""
    folder.mkdir(parents=True, exist_ok=True)
    generate_rows = [{"context": context, "target": noun} for context, noun in NOUN_ENDINGS]
    choice_rows = []
    for index, (context, noun) in enumerate(NOUN_ENDINGS):
        others = [word for word in OTHER_NOUNS if word != noun][:2] or list(OTHER_NOUNS)
        choices = [noun, *others] if index % 2 else [*others, noun]
        choice_rows.append({"context": context, "choices": choices, "answer": choices.index(noun)})
    rolling_rows = [{"text": f"{context} {noun} . {NOUN_ENDINGS[index - 1][0]} cat ."}
                    for index, (context, noun) in enumerate(NOUN_ENDINGS)]
    paths = []
    for name, rows, template in (("gen", generate_rows, GENERATE_TASK), ("mc", choice_rows, CHOICE_TASK),
                                 ("ppl", rolling_rows, ROLLING_TASK)):
        data = folder / f"nouns_{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        task = folder / f"nouns_{name}.yaml"
        task.write_text(template.format(data=data.resolve()))
        paths.append(task)
    return paths[0], paths[1], paths[2]


def save_sharp_base(directory: Path, scale: float = 10.0) -> Path:
    """The tiny GPT-2 (:func:`~tests.helpers.models.tiny_spec`) with its (tied) embeddings ``scale`` times the random
    initialisation's, saved with its tokenizer: at GPT-2's initial scale the logits span a fraction of a nat, which no
    LoRA adapter can widen (the head is the embeddings); here an adapter can learn to answer."""
    torch.manual_seed(0)
    spec = tiny_spec()
    tokenizer = load_tokenizer(spec)
    model = load_causal_lm(spec, tokenizer)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def train_noun_adapter(model_dir: Path, out: Path, steps: int = 100, seed: int = 0) -> Path:
    """A ``policy`` LoRA adapter on the model in ``model_dir`` trained (Adam, next-token loss) on the sentences of
    :data:`NOUN_ENDINGS` with their noun and a stop, saved as the stages export it (with the base's fingerprint);
    returns its folder."""
    torch.manual_seed(seed)
    spec = BaseModelSpec(name_or_path=str(model_dir))
    tokenizer = load_tokenizer(spec)
    shared = SharedBase(load_causal_lm(spec, tokenizer))
    shared.add_adapter("policy", LORA)
    texts = [f"{context} {noun} ." for context, noun in NOUN_ENDINGS]
    encoded = tokenizer(texts, padding="longest", return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)[:, 1:]
    optimizer = torch.optim.Adam([p for p in shared.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        with shared.role("policy"):
            logits = shared.next_token_logits(ids, mask)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return shared.save_adapter("policy", out)


def evaluation_models(root: Path) -> tuple[Path, Path, tuple[Path, Path, Path]]:
    """``(base folder, adapter folder, (generation task, multiple-choice task, perplexity task))`` under ``root``:
    the sharp tiny base, the noun adapter trained on it and the local task YAMLs."""
    base = save_sharp_base(root / "base")
    return base, train_noun_adapter(base, root / "adapters"), write_tasks(root / "tasks")
