"""Every W&B sweep in ``sweeps/`` is checked against the CLI without a W&B server.

For each sweep file: parameter sets are drawn from its declared distributions (the low corner, the high corner
and random draws that visit every listed value); wandb's own agent turns each set into the command it would
launch (``wandb.wandb_agent.Agent._command_run``, which formats the values with
``wandb.sdk.launch.sweeps.utils.create_sweep_command_args`` and substitutes ``${env}``, ``${interpreter}`` and
``${args}``); LightningCLI must accept that command and every swept value must reach the instantiated module.
The slow tests run two tiny trials per stage end to end with W&B offline and check that the sweep's metric is
in each run's history, so a sweep can never optimise a metric that nothing logs.
"""

from __future__ import annotations

import importlib
import math
import random
import sys
import time
import zlib
from collections.abc import Callable, Mapping
from itertools import product
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.callbacks import Checkpoint

from rlhf_lightning.algorithms.registered import Registered
from rlhf_lightning.cli import RLHFCLI, main
from rlhf_lightning.core.online import OnlineRL
from rlhf_lightning.runs.resume import import_class
from rlhf_lightning.runs.wandb_offline import read_config, read_history

REPO = Path(__file__).resolve().parents[2]
SWEEP_FILES = sorted((REPO / "sweeps").glob("*.yaml"))
SWEEPS = {path.stem: path for path in SWEEP_FILES}
# The sweeps whose trials the slow test runs end to end: at least one per stage config that any sweep uses
# (test_every_stage_with_a_sweep_has_an_end_to_end_trial keeps it so).
END_TO_END = ("ppo_bayes", "reward_model", "grpo", "dpo", "kto", "online_dpo")
METHODS = {"grid", "random", "bayes"}
# What the agent puts in place of ${env} and ${interpreter} (wandb_agent.Agent._command_run).
AGENT_ENV, AGENT_INTERPRETER = "/usr/bin/env", "python"
AGENT_VARIABLES = ("WANDB_DIR", "WANDB_SWEEP_ID", "WANDB_RUN_ID", "WANDB_SWEEP_PARAM_PATH")


# ---- reading a sweep --------------------------------------------------------------------------------------


def load_sweep(path: Path) -> dict[str, Any]:
    """The sweep config as ``wandb sweep`` reads it (wandb's ``load_sweep_config``: ``yaml.safe_load``)."""
    from wandb.sdk.launch.sweeps.utils import load_sweep_config

    sweep = load_sweep_config(str(path))
    assert isinstance(sweep, dict), f"{path}: wandb sweep cannot read it"
    return sweep


def stage_config(sweep: dict[str, Any]) -> str:
    """The stage config the sweep's command passes to ``--config`` (relative to the repository root)."""
    command = [str(part) for part in sweep["command"]]
    assert command.count("--config") == 1, f"the command needs exactly one --config: {command}"
    return command[command.index("--config") + 1]


def stage_save_dir(config: str) -> str:
    """Where the stage config's W&B logger writes (the main run's outputs): its run folder."""
    return yaml.safe_load((REPO / config).read_text())["trainer"]["default_root_dir"]


def trial_save_dir(sweep: dict[str, Any]) -> str:
    """Where the sweep's trials write their W&B runs: the command's run folder, else the stage's."""
    fixed = dict(str(part).removeprefix("--").split("=", 1) for part in sweep["command"]
                 if str(part).startswith("--") and "=" in str(part))
    return fixed.get("trainer.default_root_dir", stage_save_dir(stage_config(sweep)))


def option_key(argument: str) -> str:
    """``--model.init_args.optimizer.lr=3e-4`` -> ``model.init_args.optimizer.lr``."""
    return argument.removeprefix("--").split("=", 1)[0]


# ---- drawing parameter sets like the W&B controller ---------------------------------------------------------

SPEC_KEYS = {"distribution", "values", "probabilities", "value", "min", "max", "q"}


def distribution_of(name: str, spec: Mapping[str, Any]) -> str:
    """The W&B distribution of a parameter, inferred from its keys when not named (as the W&B backend does)."""
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        pytest.fail(f"parameter {name}: keys {sorted(unknown)} (nested parameters, normal, beta, ...) are not "
                    "handled by test_sweeps' sampler; teach draw_value about them")
    if "distribution" in spec:
        return spec["distribution"]
    if "values" in spec:
        return "categorical"
    if "value" in spec:
        return "constant"
    if isinstance(spec.get("min"), int) and isinstance(spec.get("max"), int):
        return "int_uniform"
    return "uniform"


def _quantize(value: float, spec: Mapping[str, Any]) -> float:
    # W&B's q_ distributions return round(x / q) * q as a float, even for whole numbers: an int parameter
    # swept with one would receive "32.0", which this test must see.
    q = spec.get("q", 1)
    return float(round(value / q) * q)


# Each continuous distribution: (low corner, high corner, random draw), after W&B's definitions.
CONTINUOUS: dict[str, Callable[[Mapping[str, Any], random.Random], tuple[Any, Any, Any]]] = {
    "int_uniform": lambda s, rng: (s["min"], s["max"], rng.randint(s["min"], s["max"])),
    "uniform": lambda s, rng: (s["min"], s["max"], rng.uniform(s["min"], s["max"])),
    "q_uniform": lambda s, rng: tuple(_quantize(x, s) for x in (s["min"], s["max"], rng.uniform(s["min"], s["max"]))),
    # log_uniform: min and max are natural logarithms of the bounds; the _values variants take the bounds.
    "log_uniform": lambda s, rng: (math.exp(s["min"]), math.exp(s["max"]), math.exp(rng.uniform(s["min"], s["max"]))),
    "log_uniform_values": lambda s, rng: (
        s["min"], s["max"], math.exp(rng.uniform(math.log(s["min"]), math.log(s["max"])))),
    "q_log_uniform_values": lambda s, rng: tuple(_quantize(x, s) for x in (
        s["min"], s["max"], math.exp(rng.uniform(math.log(s["min"]), math.log(s["max"]))))),
}


def draw_value(name: str, spec: Mapping[str, Any], which: str, index: int, rng: random.Random) -> Any:
    """One value of a parameter: ``which`` is ``low``, ``high`` or ``random`` (the ``index``-th random draw)."""
    kind = distribution_of(name, spec)
    if kind == "constant":
        return spec["value"]
    if kind == "categorical":
        values = spec["values"]
        if which == "low":
            return values[0]
        if which == "high":
            return values[-1]
        if len(values) > 2 and "probabilities" not in spec:  # the random draws visit the inner values in turn
            return values[1 + index % (len(values) - 2)]
        return rng.choices(values, weights=spec.get("probabilities"))[0]
    if kind not in CONTINUOUS:
        pytest.fail(f"parameter {name}: distribution {kind!r} is not handled by test_sweeps' sampler; add it to "
                    "CONTINUOUS so that its draws are checked against the CLI")
    for bound in ("min", "max"):
        # PyYAML reads 1e-3 (no dot) as a string; wandb sweep would send that string to the server.
        assert isinstance(spec.get(bound), int | float), f"parameter {name}: {bound} must be a number, found " \
            f"{spec.get(bound)!r} (write 1.0e-3, not 1e-3)"
    assert spec["min"] < spec["max"], f"parameter {name}: min must be below max"
    low, high, drawn = CONTINUOUS[kind](spec, rng)
    return {"low": low, "high": high, "random": drawn}[which]


def draw_parameter_sets(sweep: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    """The low corner, the high corner, then random draws: enough of them that every listed value is drawn."""
    parameters = sweep["parameters"]
    longest = max((len(spec.get("values", [])) for spec in parameters.values()), default=0)
    rng = random.Random(seed)
    which = ["low", "high"] + ["random"] * max(1, longest - 2)
    return [{name: draw_value(name, spec, kind, index - 2, rng) for name, spec in parameters.items()}
            for index, kind in enumerate(which)]


def grid_points(sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """Every point of a grid sweep, as the W&B grid search enumerates them."""
    names = list(sweep["parameters"])
    choices = [spec["values"] if "values" in spec else [spec["value"]] for spec in sweep["parameters"].values()]
    return [dict(zip(names, point, strict=True)) for point in product(*choices)]


def sweep_seed(path: Path) -> int:
    """A fixed seed per sweep file, so its draws (and the trials' cost) are the same on every run."""
    return zlib.crc32(path.name.encode())


# ---- the command the W&B agent runs -----------------------------------------------------------------------


def agent_command(sweep: dict[str, Any], params: dict[str, Any], run_id: str, monkeypatch: pytest.MonkeyPatch,
                  wandb_dir: Path) -> list[str]:
    """The command wandb's agent launches for a run with ``params``, built by the agent itself.

    ``Agent._command_run`` turns the server's run command into the process it starts: ``${args}`` becomes
    ``create_sweep_command_args(...)["args"]`` (``--key=value``), ``${env}`` and ``${interpreter}`` become
    ``/usr/bin/env`` and ``python``. The process is recorded instead of started. As the real agent does, it
    leaves ``WANDB_RUN_ID`` and ``WANDB_SWEEP_PARAM_PATH`` in ``os.environ`` (restored by ``monkeypatch``), which
    is what an in-process trial then sees.
    """
    from wandb import wandb_agent

    for variable in AGENT_VARIABLES:  # let monkeypatch restore whatever the agent sets
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SWEEP_ID", "local-sweep")  # run_agent sets it from the sweep path
    launched: list[list[str]] = []

    class RecordedProcess:
        """Stands in for ``AgentProcess``: records the command instead of starting it."""

        def __init__(self, command: list[str] | None = None, **kwargs: Any) -> None:
            launched.append(command)

    monkeypatch.setattr(wandb_agent, "AgentProcess", RecordedProcess)
    agent = wandb_agent.Agent(api=None, queue=None, sweep_id="local-sweep")
    agent._sweep_command = list(sweep["command"])  # what Agent.run takes from the sweep's YAML
    agent._command_run({"type": "run", "run_id": run_id, "program": sweep.get("program"),
                        "args": {name: {"value": value} for name, value in params.items()}})
    assert len(launched) == 1 and launched[0], "the agent launched no command"
    return launched[0]


def cli_arguments(command: list[str]) -> list[str]:
    """The arguments ``python -m rlhf_lightning`` receives from an agent command (``fit --config ...``)."""
    rest = command[1:] if command[0] == AGENT_ENV else command
    assert rest[:3] == [AGENT_INTERPRETER, "-m", "rlhf_lightning"], \
        f"a sweep command must run `${{env}} ${{interpreter}} -m rlhf_lightning ...`, got {command}"
    assert rest[3] == "fit", f"sweep trials train: the subcommand must be fit, got {rest[3]!r}"
    return rest[3:]


# ---- tiny runs of the stages --------------------------------------------------------------------------------

RUN_QUIETLY = ["--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
               "--trainer.enable_model_summary=false"]


def tiny_overrides(config: str, tiny_model_dir: Path, reward_dir: Path, run: bool) -> list[str]:
    """Arguments that put a sweep trial on the tiny model (and, with ``run``, make it a few seconds long).

    They are appended after the sweep's arguments, so they must never touch a swept key (checked by
    ``with_tiny_overrides``).
    """
    lora = "{r: 4, alpha: 8}"  # conftest's reward adapter: critic.from_reward needs the critic to match it
    models = {
        "configs/ppo.yaml": [f"--model.init_args.base.name_or_path={tiny_model_dir}",
                             f"--model.init_args.reward.init_args.path={reward_dir}",
                             f"--model.init_args.policy_lora={lora}", f"--model.init_args.critic.lora={lora}"],
        "configs/reward.yaml": [f"--model.init_args.base.name_or_path={tiny_model_dir}"],
        "configs/dpo.yaml": [f"--model.init_args.base.name_or_path={tiny_model_dir}",
                             f"--model.init_args.policy_lora={lora}"],
        "configs/grpo.yaml": [f"--model.init_args.base.name_or_path={tiny_model_dir}",
                              f"--model.init_args.reward.init_args.path={reward_dir}",
                              f"--model.init_args.policy_lora={lora}"],
    }
    models["configs/kto.yaml"] = models["configs/dpo.yaml"]
    models["configs/online_dpo.yaml"] = models["configs/grpo.yaml"]
    runs = {
        # One PPO iteration on a real-size rollout batch (64 prompts, so num_minibatches is checked as in a real
        # trial), then validation on the held-out prompts.
        "configs/ppo.yaml": ["--model.init_args.sampling.max_new_tokens=6", "--data.init_args.synthetic_rows=80",
                             "--trainer.max_epochs=1", "--trainer.limit_train_batches=1",
                             "--trainer.val_check_interval=1"],
        "configs/dpo.yaml": ["--model.init_args.sampling.max_new_tokens=6", "--data.init_args.synthetic_rows=80",
                             "--data.init_args.batch_size=8", "--data.init_args.val_batch_size=8",
                             "--trainer.max_steps=2", "--trainer.val_check_interval=2",
                             "--trainer.log_every_n_steps=1"],
        "configs/grpo.yaml": ["--model.init_args.sampling.max_new_tokens=6", "--data.init_args.synthetic_rows=40",
                              "--trainer.max_epochs=1", "--trainer.limit_train_batches=1",
                              "--trainer.val_check_interval=1"],
        "configs/online_dpo.yaml": ["--model.init_args.sampling.max_new_tokens=6",
                                    "--data.init_args.synthetic_rows=40", "--data.init_args.batch_size=8",
                                    "--trainer.max_epochs=1", "--trainer.limit_train_batches=1",
                                    "--trainer.val_check_interval=1"],
        "configs/reward.yaml": ["--data.init_args.synthetic_rows=40", "--data.init_args.batch_size=8",
                                "--trainer.max_steps=2", "--trainer.val_check_interval=2",
                                "--trainer.log_every_n_steps=1"],
    }
    runs["configs/kto.yaml"] = runs["configs/dpo.yaml"]
    if config not in models:
        pytest.fail(f"test_sweeps does not know how to make a tiny run of {config}: add it to tiny_overrides")
    return models[config] + (runs[config] + RUN_QUIETLY if run else [])


def with_tiny_overrides(arguments: list[str], sweep: dict[str, Any], overrides: list[str]) -> list[str]:
    """``arguments`` followed by ``overrides``, after checking that no override masks a swept value."""
    swept = set(sweep["parameters"])
    for override in map(option_key, overrides):
        clashes = {key for key in swept if key == override or key.startswith(override + ".")
                   or override.startswith(key + ".")}
        assert not clashes, f"the test's override {override} would hide the swept {sorted(clashes)}"
    return arguments + overrides


def instantiated_value(cli: RLHFCLI, key: str) -> Any:
    """The value that ``key`` (a CLI dotted key) has on the instantiated module, data module or trainer."""
    head, *path = key.split(".")
    if head in ("model", "data"):
        assert path[:1] == ["init_args"], f"{key}: the configs use subclass mode, so keys read {head}.init_args.*"
        target, path = (cli.model if head == "model" else cli.datamodule), path[1:]
        saved = target.hparams.get(path[0])
        # what the module saved with save_hyperparameters, else its attribute (a group given by class_path, such as
        # policy_loss, is the object the module built from it)
        if path[0] in target.hparams and not (isinstance(saved, Mapping) and "class_path" in saved):
            target, path = saved, path[1:]
    elif head == "trainer":
        target = cli.trainer
    else:
        pytest.fail(f"{key}: test_sweeps cannot find {head!r} on the instantiated CLI; teach instantiated_value")
    for part in path:
        target = target[part] if isinstance(target, Mapping) else getattr(target, part)
    return as_given(target)


def as_given(value: Any) -> Any:
    """A registered loss (``preference_loss: IPO``) as a sweep names it, by its class name with its defaults; any
    other value as it is."""
    if isinstance(value, Registered) and value == type(value)():
        return type(value).__name__
    if isinstance(value, Mapping) and set(value) == {"class_path", "init_args"}:  # a run's stored config
        cls = import_class(value["class_path"])
        if isinstance(cls, type) and issubclass(cls, Registered) and cls(**value["init_args"]) == cls():
            return cls.__name__
    return value


def nested(config: Mapping[str, Any], key: str) -> Any:
    """``config['model']['init_args']['kl']['coef']`` for ``model.init_args.kl.coef``; a group given by
    ``class_path`` may omit its ``init_args`` (``policy_loss.clip_range``), as the command line does."""
    for part in key.split("."):
        if part not in config and "init_args" in config:
            config = config["init_args"]
        config = config[part]
    return as_given(config)


# ---- fast checks ------------------------------------------------------------------------------------------


@pytest.fixture
def repo_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working folder of a trial, laid out like the repository root the agent runs in: the sweep commands
    name ``configs/<stage>.yaml`` relative to it. Outputs land in ``tmp_path``, never in the repository."""
    assert Path.cwd() == tmp_path  # conftest runs every test in its tmp_path
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.setattr(sys, "argv", ["rlhf_lightning"])  # a trial's arguments come from the agent only
    return tmp_path


def test_there_are_sweeps_for_ppo_and_the_reward_model():
    assert set(END_TO_END) <= set(SWEEPS)
    assert {stage_config(load_sweep(path)) for path in SWEEP_FILES} >= {"configs/ppo.yaml", "configs/reward.yaml"}


def test_every_stage_with_a_sweep_has_an_end_to_end_trial():
    covered = {stage_config(load_sweep(SWEEPS[name])) for name in END_TO_END}
    for path in SWEEP_FILES:
        assert stage_config(load_sweep(path)) in covered, \
            f"{path.name}: no slow test runs its stage, so nothing proves its metric is logged; add a sweep of " \
            "that stage to END_TO_END"


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda path: path.name)
def test_sweep_file_is_well_formed(path):
    text = path.read_text()
    assert text.startswith("#") and "wandb sweep sweeps/" in text and "wandb agent" in text, \
        "the header comment must say what the sweep does and how to launch it"
    sweep = load_sweep(path)
    assert sweep["method"] in METHODS
    assert sweep["metric"]["goal"] in ("maximize", "minimize") and sweep["metric"]["name"]
    assert sweep["parameters"], "a sweep sweeps something"
    if sweep["method"] == "grid":  # W&B's grid search enumerates listed values only
        assert all("values" in spec or "value" in spec for spec in sweep["parameters"].values())
        assert len(grid_points(sweep)) > 1
    command = [str(part) for part in sweep["command"]]
    assert command[:4] == ["${env}", "${interpreter}", "-m", "rlhf_lightning"] and command[-1] == "${args}"
    assert (REPO / stage_config(sweep)).is_file()
    for spec in sweep["parameters"].values():  # a null would reach the CLI as the string "None"
        assert None not in spec.get("values", []) and ("value" not in spec or spec["value"] is not None)


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda path: path.name)
def test_every_drawn_trial_parses_and_reaches_the_module(path, repo_cwd, tiny_model_dir, reward_dir, monkeypatch):
    sweep = load_sweep(path)
    config = stage_config(sweep)
    stage = yaml.safe_load((REPO / config).read_text())
    overrides = tiny_overrides(config, tiny_model_dir, reward_dir, run=False)
    for index, params in enumerate(draw_parameter_sets(sweep, sweep_seed(path))):
        command = agent_command(sweep, params, f"draw{index}", monkeypatch, repo_cwd)
        arguments = cli_arguments(command)
        assert [option_key(argument) for argument in arguments[-len(params):]] == list(params)  # ${args} last
        cli = RLHFCLI(args=with_tiny_overrides(arguments[1:], sweep, overrides), run=False)

        for name, value in params.items():
            assert instantiated_value(cli, name) == value, f"{path.name}: {name}={value!r} did not reach the module"
        if isinstance(cli.model, OnlineRL):  # the rollout batch must split into the drawn minibatches
            cli.model.updater.minibatch_sizes(cli.datamodule.batch_size * cli.model.hparams.samples_per_prompt)

        # A trial never writes into the main run's outputs: no checkpoints, no export, its own W&B folder...
        assert not any(isinstance(callback, Checkpoint) for callback in cli.trainer.callbacks)
        assert not cli.model.hparams.get("export_dir")
        assert cli.trainer.logger.save_dir == trial_save_dir(sweep) != stage_save_dir(config)
        # ... and keeps every other callback of the stage config (e.g. the PPO completions table).
        for callback in stage["trainer"].get("callbacks", []):
            module, _, name = callback["class_path"].rpartition(".")
            cls = getattr(importlib.import_module(module), name)
            assert issubclass(cls, Checkpoint) or any(isinstance(c, cls) for c in cli.trainer.callbacks), \
                f"{path.name} drops the {name} callback of {config}"


def test_sampler_covers_every_listed_value_and_refuses_what_it_cannot_draw():
    sweep = {"parameters": {"a": {"values": [1, 2, 4, 8]}, "b": {"min": 1, "max": 3},
                            "c": {"distribution": "log_uniform_values", "min": 1.0e-4, "max": 1.0e-2}}}
    draws = draw_parameter_sets(sweep, seed=0)
    assert {draw["a"] for draw in draws} == {1, 2, 4, 8}
    assert [draws[0]["b"], draws[1]["b"]] == [1, 3] and all(isinstance(draw["b"], int) for draw in draws)
    assert all(1.0e-4 <= draw["c"] <= 1.0e-2 for draw in draws)
    with pytest.raises(pytest.fail.Exception, match="not handled"):
        draw_parameter_sets({"parameters": {"x": {"distribution": "normal", "mu": 0, "sigma": 1}}}, seed=0)
    with pytest.raises(pytest.fail.Exception, match="not handled"):
        draw_parameter_sets({"parameters": {"x": {"distribution": "beta", "min": 0, "max": 1}}}, seed=0)
    with pytest.raises(AssertionError, match="must be a number"):
        draw_parameter_sets({"parameters": {"x": {"distribution": "uniform", "min": "1e-3", "max": 1.0}}}, seed=0)


# ---- slow: trials end to end ------------------------------------------------------------------------------


def logged_history(save_dir: Path, run_id: str, metric: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """History rows of the offline W&B run ``run_id`` under ``save_dir``. W&B's writer is a separate process, so
    give the file a few seconds to show the metric on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        files = list(save_dir.rglob(f"run-{run_id}.wandb"))
        assert len(files) <= 1, f"several runs {run_id}: {files}"
        rows = read_history(files[0]) if files else []
        if any(metric in row for row in rows) or time.monotonic() > deadline:
            assert files, f"no W&B run {run_id} under {save_dir}"
            return rows
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("name", END_TO_END)
def test_two_trials_run_end_to_end_and_log_the_sweep_metric(name, repo_cwd, tiny_model_dir, reward_dir,
                                                              monkeypatch):
    """Two trials (the low and the high corner of the sweep's space) run as the agent would run them, in this
    process like the agent's function mode (``wandb.teardown()`` between runs), with W&B offline."""
    import wandb

    sweep = load_sweep(SWEEPS[name])
    config, metric = stage_config(sweep), sweep["metric"]["name"]
    overrides = tiny_overrides(config, tiny_model_dir, reward_dir, run=True)
    save_dir = repo_cwd / trial_save_dir(sweep)
    logged: set[str] = set()
    try:
        for index, params in enumerate(draw_parameter_sets(sweep, sweep_seed(SWEEPS[name]))[:2]):
            run_id = f"{name.replace('_', '')}{index}"
            arguments = cli_arguments(agent_command(sweep, params, run_id, monkeypatch, repo_cwd))
            wandb.teardown()  # a fresh W&B setup reads this run's id and sweep parameters, as a new process would
            main(with_tiny_overrides(arguments, sweep, overrides))

            rows = logged_history(save_dir, run_id, metric)
            values = [row[metric] for row in rows if metric in row]
            assert values and all(math.isfinite(value) for value in values), f"trial {params}: {metric} not logged"
            logged |= {key for row in rows for key in row}
            run_config = read_config(next(save_dir.rglob(f"run-{run_id}.wandb")))["cli"]
            for key, value in params.items():  # the run's stored config is what the trial really ran with
                assert nested(run_config, key) == value
    finally:
        wandb.teardown()  # later tests must not inherit this run's W&B settings
    for path in SWEEP_FILES:  # sweeps of the same stage must optimise something these real runs logged
        other = load_sweep(path)
        if stage_config(other) == config:
            assert other["metric"]["name"] in logged, f"{path.name}: {other['metric']['name']} is never logged"
