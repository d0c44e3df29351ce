"""``python -m rlhf_lightning evaluate``: lm-evaluation-harness tasks on a model of ours (a policy adapter on its base,
a merged model, or a run folder's export), the results as a JSON file and lm-eval's table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_lightning.evaluation.evaluated_model import load_model, model_to_evaluate
from rlhf_lightning.evaluation.harness import (
    HarnessSettings,
    parse_gen_kwargs,
    results_table,
    run_tasks,
    write_results,
)
from rlhf_lightning.evaluation.tasks import load_tasks, select_tasks, task_manager
from rlhf_lightning.models.spec import Dtype

INSTALL_HINT = "pip install -e '.[eval]' (in the repository's clone)"


def require_harness() -> None:
    """lm-evaluation-harness (the ``eval`` extra) must be installed: one line saying how, else."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as error:
        raise RuntimeError(f"evaluate needs lm-evaluation-harness ({error}): {INSTALL_HINT}") from error


def evaluate(model: str, tasks: str, base: str | None = None, include_path: list[str] | None = None,
             batch_size: int = 8, limit: int | float | None = None, num_fewshot: int | None = None,
             apply_chat_template: bool | str = False, fewshot_as_multiturn: bool = True,
             system_instruction: str | None = None, gen_kwargs: str | None = None, max_gen_toks: int = 256,
             max_length: int | None = None, device: str = "auto", dtype: Dtype = "auto", seed: int | None = None,
             bootstrap_iters: int = 100_000, log_samples: bool = False,
             output: str = "lm_eval_results.json") -> dict[str, Any]:
    """Run lm-evaluation-harness tasks on a model of ours; print lm-eval's table and write the results as JSON.

    Args:
        model: what to evaluate: a peft adapter folder on its base (``outputs/ppo/adapters/policy``), a
            transformers model folder (a merged model, ``outputs/sft/model``), a run folder (``outputs/ppo``: its
            policy adapter, else its exported model) or a hub id.
        tasks: lm-eval task names or globs, or task YAML files, comma-separated (``hellaswag,my_task.yaml``).
        base: the base model of an adapter; default: the one its adapter_config.json records.
        include_path: folders of task YAML files to find tasks in, besides lm-eval's own.
        batch_size: requests per forward pass (rows of a generation).
        limit: examples per task (a count), or a share of them (below 1); null = all.
        num_fewshot: examples in each prompt; null = each task's own.
        apply_chat_template: wrap prompts in the tokenizer's chat template (true, or a template's name).
        fewshot_as_multiturn: with a chat template, few-shot examples as turns of the conversation.
        system_instruction: a system message before every prompt.
        gen_kwargs: generation settings over the tasks' own, lm-eval's spelling: ``temperature=0,max_gen_toks=64``
            (also ``do_sample``, ``top_p``, ``top_k``).
        max_gen_toks: tokens generated when a task does not say.
        max_length: tokens of context; null = the model's.
        device: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:1``...
        dtype: dtype of the loaded weights; ``auto`` keeps the checkpoint's.
        seed: Python, NumPy, torch and few-shot seed; null = lm-eval's.
        bootstrap_iters: bootstrap draws for standard errors without a closed form; 0 = no standard errors.
        log_samples: write every example's prompt and answers into the results file.
        output: the results file (JSON), replaced if it exists.
    """
    require_harness()
    from rlhf_lightning.evaluation.harness_lm import SharedBaseLM

    settings = HarnessSettings(limit, num_fewshot, apply_chat_template, fewshot_as_multiturn, system_instruction,
                               parse_gen_kwargs(gen_kwargs), bootstrap_iters, seed, log_samples).check()
    target = model_to_evaluate(model, base)  # before the tasks' data: a wrong path fails at once
    selection = select_tasks([tasks], include_path or [])
    manager = task_manager(selection)
    loaded = load_tasks(manager, selection)  # before the model: a task that cannot be read fails in seconds
    shared, tokenizer, role = load_model(target, None if device == "auto" else device, dtype)
    lm = SharedBaseLM(shared, tokenizer, role, batch_size, max_length, max_gen_toks)
    results = run_tasks(lm, loaded, settings, manager)
    path = write_results(results, output, {**target.describe(), "role": role}, settings)
    print(results_table(results), flush=True)
    print(f"results: {shown(path)}", flush=True)
    return results


def shown(path: Path) -> str:
    """``path`` relative to where the command runs, when it lies under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def main(args: Sequence[str]) -> None:
    """``python -m rlhf_lightning evaluate --model PATH --tasks TASKS [options]`` (``--help`` lists them), parsed
    with the command line's one-line errors."""
    from jsonargparse import ActionConfigFile

    from rlhf_lightning.cli.command_line import OneLineArgumentParser

    parser = OneLineArgumentParser(prog="python -m rlhf_lightning evaluate",
                                   description=evaluate.__doc__.split("\n\n")[0])
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these arguments")
    parser.add_function_arguments(evaluate, as_group=False)
    config = parser.parse_args(list(args))
    init: dict[str, Any] = config.as_dict()  # plain values: nothing to instantiate
    init.pop("config", None)
    evaluate(**init)
