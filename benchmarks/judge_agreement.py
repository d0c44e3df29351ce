"""How often a judge adapter agrees with the arithmetic task's exact checker, on the responses the SFT policy itself
samples (temperature 1, as GRPO samples them) to held-out problems of another seed than training's. Run by hand
after ``configs/arithmetic_judge_sft.yaml``, from the repository::

    python benchmarks/judge_agreement.py outputs/arithmetic/sft/model outputs/arithmetic/judge/adapters/sft

It prints one line: the SFT policy's accuracy by the checker, the judge's agreement with the checker (its verdict
is P("1") > 0.5), the share it calls correct, and its mean P("1") on the right and on the wrong responses.
"""

from __future__ import annotations

import argparse

import torch

from rlhf_lightning import JudgeReward
from rlhf_lightning.data.collate import pad
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.tasks.arithmetic import exact_match
from rlhf_lightning.tasks.arithmetic_judge import JUDGE_TEMPLATE, VERDICTS, ArithmeticJudgeTask


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sft_model", help="the policy's SFT model folder (the judge adapter's base)")
    parser.add_argument("judge_adapter", help="the judge adapter folder (the judge stage's adapters/sft)")
    parser.add_argument("--responses", type=int, default=512, help="problems, one sampled response each")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="as configs/arithmetic_grpo_judge.yaml")
    parser.add_argument("--problem-seed", type=int, default=123, help="the held-out problems' seed")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed")
    return parser.parse_args(argv)


def agreement_line(p_right: torch.Tensor, gold: torch.Tensor) -> str:
    """The printed line: the judge's P("1") per response against the checker's 0/1 verdicts ``gold``."""
    verdict = (p_right > 0.5).float()

    def mean_where(keep: torch.Tensor) -> str:
        return f"{p_right[keep].mean():.4f}" if keep.any() else "n/a"

    return (f"responses {len(gold)} · checker accuracy of the SFT policy {gold.float().mean():.4f} · judge agreement "
            f"with the checker {(verdict == gold).float().mean():.4f} · judge says correct {verdict.mean():.4f} · "
            f"P(1) on right {mean_where(gold == 1)} · on wrong {mean_where(gold == 0)}")


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    spec = BaseModelSpec(name_or_path=args.sft_model)
    tokenizer = load_tokenizer(spec)
    base = SharedBase(load_causal_lm(spec, tokenizer)).eval()
    judge = JudgeReward(JUDGE_TEMPLATE, parser="logprob", labels=VERDICTS, adapter=args.judge_adapter)
    judge.setup(base, tokenizer)
    rows = ArithmeticJudgeTask(seed=args.problem_seed).prompt_rows(args.responses)
    torch.manual_seed(args.seed)
    prompts, completions = [], []
    for start in range(0, len(rows), 128):
        batch = rows[start:start + 128]
        ids, mask = pad([tokenizer(row["prompt"])["input_ids"] for row in batch], tokenizer.pad_token_id, side="left")
        with torch.no_grad(), base.role(None):
            out = base.hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                         max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id)
        completions += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        prompts += [row["prompt"] for row in batch]
    n = len(rows)
    columns = {"reference": [row["reference"] for row in rows], "answer": [row["answer"] for row in rows]}
    inputs = RewardInputs(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1), torch.zeros(n, dtype=torch.long),
                          prompts, completions, [[0]] * n, columns)
    gold = torch.tensor(exact_match(prompts, completions, answer=columns["answer"]))
    line = agreement_line(judge.score(inputs), gold)
    print(line)
    return line


if __name__ == "__main__":
    main()
