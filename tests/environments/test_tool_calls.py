"""Tools, tool-call formats and environments: parsed as the chat templates write them, failures answered as text,
and bad environments stopped with one line."""

from __future__ import annotations

import math
import time
import types

import numpy as np
import pytest

from rlhf_lightning import GRPO
from rlhf_lightning.environments import Environment, Step, Tool, ToolEnvironment
from rlhf_lightning.environments.environment import checked_reset, checked_step
from rlhf_lightning.environments.tool_calls import HermesFormat, Llama3JsonFormat, detect_format
from rlhf_lightning.environments.tools import ToolResult
from rlhf_lightning.tasks.calculator import add, build_tokenizer
from tests.helpers.cli import REPO, cli_subprocess
from tests.helpers.episodes import episodic
from tests.helpers.families import CHATML_TEMPLATE, FAMILIES, LLAMA3_TEMPLATE
from tests.helpers.families import build_tokenizer as family_tokenizer

# The tiny families' templates with tool calling, in the shape of Qwen2.5's and Llama 3.1's own.
QWEN_TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>{% else %}{{ m['content'] }}"
    "{% endif %}{% if m['tool_calls'] is defined %}{% for call in m['tool_calls'] %}\n<tool_call>\n"
    "{{ call['function'] | tojson }}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TOOL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}"
    "<|end_header_id|>\n\n{% if m['tool_calls'] is defined %}{% for call in m['tool_calls'] %}"
    '{"name": "{{ call["function"]["name"] }}", "parameters": {{ call["function"]["arguments"] | tojson }}}'
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def family_with(name: str, template: str):
    tokenizer = family_tokenizer(FAMILIES[name])
    tokenizer.chat_template = template
    return tokenizer


def test_the_format_is_read_from_what_the_template_renders():
    assert isinstance(detect_format(family_with("qwen2", QWEN_TOOL_TEMPLATE)), HermesFormat)
    assert isinstance(detect_format(family_with("llama", LLAMA3_TOOL_TEMPLATE)), Llama3JsonFormat)
    assert isinstance(detect_format(build_tokenizer()), HermesFormat)


@pytest.mark.parametrize(("name", "template"), [("qwen2", CHATML_TEMPLATE), ("llama", LLAMA3_TEMPLATE)])
def test_a_template_that_drops_tool_calls_is_refused_at_setup(name, template):
    tokenizer = family_with(name, template)
    with pytest.raises(ValueError, match="drops assistant tool calls or tool messages") as error:
        detect_format(tokenizer)
    assert "\n" not in str(error.value) and "the chat template" in str(error.value)


def test_an_unknown_call_format_is_named():
    tokenizer = family_with("qwen2", QWEN_TOOL_TEMPLATE.replace("<tool_call>", "[CALL]").replace("</tool_call>", "[/CALL]"))
    with pytest.raises(ValueError, match="writes tool calls in a format this framework does not parse"):
        detect_format(tokenizer)


def assistant_turn(tokenizer, content: str, header: str, turn_end: str) -> str:
    """What the template writes for an assistant turn calling add(a=3, b=4), between its header and turn end."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": content, "tool_calls": [call]}],
                                             tokenize=False)
    return rendered.split(header, 1)[1].split(turn_end)[0]


def test_hermes_calls_are_parsed_as_qwen_writes_them():
    turn = assistant_turn(family_with("qwen2", QWEN_TOOL_TEMPLATE), "Let me add.", "<|im_start|>assistant\n",
                          "<|im_end|>")
    parsed = HermesFormat().parse(turn)
    assert parsed.content == "Let me add."
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [("add", {"a": 3, "b": 4}, None)]
    two = HermesFormat().parse('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": 1}'
                               "</tool_call><tool_call>{oops</tool_call>")
    assert [c.name for c in two.calls] == ["a", None, None]
    assert "string \"name\"" in two.calls[1].error and "not valid JSON" in two.calls[2].error
    assert HermesFormat().parse("answer 7").calls == []


def test_llama3_json_calls_are_parsed_as_llama_writes_them():
    turn = assistant_turn(family_with("llama", LLAMA3_TOOL_TEMPLATE), "", "assistant<|end_header_id|>\n\n",
                          "<|eot_id|>")
    parsed = Llama3JsonFormat().parse(turn)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 3, "b": 4})]
    assert Llama3JsonFormat().parse("<|python_tag|>" + turn).calls[0].name == "add"
    assert Llama3JsonFormat().parse("The sum is 7.").content == "The sum is 7."
    assert Llama3JsonFormat().parse('{"name": "add", "parameters": {').calls[0].error is not None


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "done"


def broken(x: int) -> int:
    """Fail.

    Args:
        x: anything.
    """
    raise ZeroDivisionError("the tool's own bug")


def test_a_tool_is_a_typed_function_and_its_failures_come_back_as_text():
    tool = Tool(add)
    assert tool.schema["function"]["name"] == "add"
    assert tool.schema["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    assert tool({"a": 2, "b": 40}).text == "42"
    assert tool({"a": 2}).status == "invalid" and "missing a required argument: 'b'" in tool({"a": 2}).text
    assert Tool(broken)({"x": 1}).text == "error: ZeroDivisionError: the tool's own bug"
    start = time.perf_counter()
    result = Tool(slow, timeout=0.2)({"seconds": 5})
    assert result.status == "timeout" and time.perf_counter() - start < 2
    assert Tool("rlhf_lightning.tasks.calculator.add").name == "add"
    with pytest.raises(ValueError, match="cannot be imported"):
        Tool("no_such_module.add")


def test_the_tool_environment_counts_calls_errors_and_malformed_ones():
    environment = ToolEnvironment(["rlhf_lightning.tasks.calculator.add", broken])
    call = lambda name, **arguments: {"type": "function", "function": {"name": name, "arguments": arguments}}  # noqa: E731
    turn = {"role": "assistant", "content": "", "invalid_tool_calls": ["the tool call is not valid JSON"],
            "tool_calls": [call("add", a=1, b=2), call("broken", x=1), call("divide", a=1)]}
    step = environment.step([{"role": "user", "content": "q"}, turn])
    assert not step.done and [m["content"] for m in step.messages] == [
        "error: the tool call is not valid JSON", "3", "error: ZeroDivisionError: the tool's own bug",
        "error: no tool named 'divide'; the tools are add, broken"]
    assert step.counts == {"invalid_tool_calls": 1, "tool_calls": 3, "tool_calls/add": 1, "tool_calls/broken": 1,
                           "tool_calls/unknown": 1, "tool_errors": 2, "tool_error": 1, "tool_unknown": 1}
    assert environment.step([{"role": "assistant", "content": "answer 3", "tool_calls": []}]).done


class Faulty(Environment):
    def __init__(self, answer):
        self.answer = answer

    def step(self, messages):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize(("answer", "expected"), [
    (KeyError("score"), "environment Faulty, row 7, turn 2: step raised KeyError: 'score'"),
    (Step(reward=math.nan), "environment Faulty, row 7, turn 2: step returned the reward nan; expected a finite"),
    ("done", "environment Faulty, row 7, turn 2: step must return a Step or (messages, reward, done), got str"),
    (([{"role": "user"}], 0.0, False), "step must return a list of messages with 'role' and 'content'"),
])
def test_an_environment_that_misbehaves_stops_the_run_with_one_line(answer, expected):
    with pytest.raises((RuntimeError, ValueError, TypeError)) as error:
        checked_step(Faulty(answer), [{"role": "user", "content": "q"}], row=7, turn=2)
    assert expected in str(error.value) and "\n" not in str(error.value)
    assert checked_step(Faulty(([{"role": "user", "content": "higher"}], 0.5, False)), [], 1, 1).reward == 0.5
    with pytest.raises(TypeError, match="environment Empty, row 3: reset must return a non-empty list"):
        checked_reset(type("Empty", (Faulty,), {"reset": lambda self, row: []})(None), {"prompt": "q"}, 3)


def numpy_count(n: int) -> np.int64:
    """Count as numpy does.

    Args:
        n: a number.
    """
    return np.int64(n)


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def returns(value):
    """A tool returning ``value``."""

    def give(x: int) -> object:
        """Give.

        Args:
            x: anything.
        """
        return value

    return give


def test_whatever_a_tool_returns_reaches_the_model_as_text():
    assert Tool(numpy_count)({"n": 7}) == ToolResult("7")
    assert Tool(returns(np.arange(3)))({"x": 1}).text == "[0, 1, 2]"
    assert Tool(returns({"mean": np.float64(0.5), "tags": {"a"}}))({"x": 1}).text == '{"mean": 0.5, "tags": "{\'a\'}"}'
    circular = []
    circular.append(circular)
    assert Tool(returns(circular))({"x": 1}).text == "[[...]]"
    unprintable = Tool(returns(Unprintable()))({"x": 1})
    assert unprintable == ToolResult("error: give returned a Unprintable that cannot be written as text "
                                     "(RuntimeError: no text)", "error")


# A tool that never returns, and an environment that calls it in every turn whatever the policy writes (a random
# tiny model writes no calls), printing what the model reads back.
STUCK_TOOL = """
import time

from rlhf_lightning.environments import ToolEnvironment


def never_returns(seconds: int) -> str:
    \"\"\"Wait.

    Args:
        seconds: how long.
    \"\"\"
    time.sleep(10**6)
    return "never"


class CallsEveryTurn(ToolEnvironment):
    def step(self, messages):
        call = {"type": "function", "function": {"name": "never_returns", "arguments": {"seconds": 1}}}
        step = super().step([*messages[:-1], {**messages[-1], "tool_calls": [call]}])
        print("tool answered:", step.messages[0]["content"], flush=True)
        return step
"""


@pytest.mark.slow
def test_a_tool_that_never_returns_costs_its_timeout_and_the_fit_exits(calculator_model_dir, tmp_path):  # noqa: F811
    (tmp_path / "stuck.py").write_text(STUCK_TOOL)
    (tmp_path / "stuck.yaml").write_text(
        "model:\n  init_args:\n    episodes:\n      environment:\n        class_path: stuck.CallsEveryTurn\n"
        "        init_args: {tools: [stuck.never_returns], timeout: 1.0}\n")
    start = time.perf_counter()
    result = cli_subprocess(
        tmp_path, "fit", "--config", str(REPO / "configs" / "calculator_grpo.yaml"), "--config", "stuck.yaml",
        f"--model.init_args.base.name_or_path={calculator_model_dir}", "--model.init_args.samples_per_prompt=2",
        "--model.init_args.episodes.max_turns=2", "--model.init_args.sampling.max_new_tokens=16",
        "--model.init_args.episodes.max_tokens=64",
        "--model.init_args.update.num_minibatches=1", "--data.init_args.batch_size=1", "--data.init_args.synthetic_rows=4",
        "--data.init_args.val_fraction=0", "--trainer.max_steps=1", "--trainer.logger=false",
        "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false")
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    answers = [line for line in result.stdout.splitlines() if line.startswith("tool answered:")]
    assert answers and set(answers) == {"tool answered: error: never_returns did not return within 1 s"}
    assert "max_steps=1" in result.stderr  # the fit ran to its end ...
    assert elapsed < 60  # ... and the process exited with the stuck threads still sleeping


GYM_STYLE = """
class GuessTheNumber:
    def __init__(self, high: int = 100):
        self.high = high

    def reset(self, row):
        return [{"role": "user", "content": "guess"}]

    def step(self, messages):
        return [], 0.0, True
"""
NOT_AN_ENVIRONMENT = ("is not an rlhf_lightning Environment: an environment must subclass "
                      "rlhf_lightning.environments.Environment (an episode calls reset(row) -> opening messages and "
                      "step(messages) -> Step(messages, reward, done)); a gym-style class keeps its reset and step "
                      "and adds the base: class GuessTheNumber(Environment)")


@pytest.mark.slow
def test_a_gym_style_environment_class_is_told_what_an_environment_must_be(tmp_path):
    (tmp_path / "gym_style.py").write_text(GYM_STYLE)
    (tmp_path / "env.yaml").write_text("model:\n  init_args:\n    episodes:\n      environment:\n        class_path: "
                                       "gym_style.GuessTheNumber\n        init_args: {high: 10}\n")
    result = cli_subprocess(tmp_path, "fit", "--config", str(REPO / "configs" / "calculator_grpo.yaml"),
                            "--config", "env.yaml", "--trainer.logger=false")
    assert result.returncode == 2, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: env.yaml:4: model.init_args.episodes.environment: gym_style.GuessTheNumber {NOT_AN_ENVIRONMENT}"]
    assert "Traceback" not in result.stderr


def test_a_gym_style_environment_given_through_the_api_gets_the_same_line(calculator_model_dir):  # noqa: F811
    gym_style = types.ModuleType("gym_style")
    exec(GYM_STYLE, gym_style.__dict__)  # noqa: S102 (the class as a user's module defines it)
    with pytest.raises(TypeError) as error:
        episodic(GRPO, calculator_model_dir, episodes={"environment": gym_style.GuessTheNumber})
    assert str(error.value) == f"episodes.environment: gym_style.GuessTheNumber {NOT_AN_ENVIRONMENT}"
