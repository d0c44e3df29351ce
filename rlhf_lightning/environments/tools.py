"""Tools as researchers write them: plain Python functions with type hints and a docstring.

transformers turns such a function into the JSON schema that chat templates take through ``tools=`` (TRL's
``tools=[...]`` takes the same functions). A call runs in a worker thread and is cut off after ``timeout``
seconds; whatever goes wrong (an exception, a timeout, arguments the function does not take) comes back as the
tool's result text, as the peers do, so the model reads its mistake and the run goes on.
"""

from __future__ import annotations

import importlib
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolResult:
    """What one call returned: the text the model reads, and how the call went (``ok``, ``error``, ``timeout``,
    ``unknown`` tool or ``invalid`` arguments)."""

    text: str
    status: str = "ok"


def import_tool(path: str) -> Callable[..., Any]:
    """The function at import path ``path`` (``package.module.function``), with a one-line error otherwise."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"tool {path!r}: expected an import path such as my_tools.calculator")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"tool {path!r}: module {module_name!r} cannot be imported ({error}); it must be "
                         "importable from where you run (or on PYTHONPATH)") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"tool {path!r}: {module_name} has no function {name!r}")
    return function


class Tool:
    """A function the policy may call by name.

    Args:
        function: a function with type hints and a Google-style docstring (transformers' ``get_json_schema``
            reads both), or its import path.
        timeout: seconds a call may run before it is cut off (its thread is abandoned: Python cannot stop it; it
            runs on until it returns, and the process exits without waiting for it).
    """

    def __init__(self, function: Callable[..., Any] | str, timeout: float = 10.0) -> None:
        self.function = import_tool(function) if isinstance(function, str) else function
        self.name = self.function.__name__
        self.timeout = timeout
        self.schema = json_schema(self.function)

    def __call__(self, arguments: Any) -> ToolResult:
        if not isinstance(arguments, dict):
            return ToolResult(f"error: the arguments of {self.name} must be a JSON object, got {arguments!r}",
                              "invalid")
        try:
            inspect.signature(self.function).bind(**arguments)
        except TypeError as error:
            return ToolResult(f"error: {self.name}: {error}", "invalid")
        outcome: dict[str, Any] = {}
        worker = threading.Thread(target=_run_into, args=(outcome, self.function, arguments), daemon=True,
                                  name=f"tool {self.name}")
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            return ToolResult(f"error: {self.name} did not return within {self.timeout:g} s", "timeout")
        if "error" in outcome:  # the model reads the tool's failure, as it would from a real API
            error = outcome["error"]
            return ToolResult(f"error: {type(error).__name__}: {error}", "error")
        try:
            return ToolResult(result_text(outcome["value"]))
        except Exception as error:  # a value whose __str__ raises: the model reads that, the run goes on
            return ToolResult(f"error: {self.name} returned a {type(outcome['value']).__name__} that cannot be "
                              f"written as text ({type(error).__name__}: {error})", "error")


def _run_into(outcome: dict[str, Any], function: Callable[..., Any], arguments: dict[str, Any]) -> None:
    """The worker thread's body: the function's value or its exception, into ``outcome``. A ``SystemExit`` or
    ``KeyboardInterrupt`` raised inside a tool is its failure too, never the run's end."""
    try:
        outcome["value"] = function(**arguments)
    except BaseException as error:  # noqa: BLE001 - whatever the tool raises is reported to the model
        outcome["error"] = error


def result_text(value: Any) -> str:
    """What a tool returned, as the text the model reads: a string as it is, anything else as JSON, numpy and
    torch values as their Python values (``np.int64(7)`` -> ``7``, an array -> a list), and what JSON cannot
    write (a set, an object of one's own, a circular structure) as its ``str()``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=_plain)
    except (TypeError, ValueError):  # a circular structure, or a tolist() that JSON cannot write either
        return str(value)


def _plain(value: Any) -> Any:
    """``json.dumps``' fallback: numpy scalars and arrays (and tensors) by ``tolist()``, anything else by ``str()``."""
    to_list = getattr(value, "tolist", None)
    return to_list() if callable(to_list) else str(value)

def json_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The function's JSON schema as chat templates take it, or a one-line error naming what is missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as error:
        raise ValueError(f"tool {function.__module__}.{function.__name__}: {error} (a tool needs type hints and a "
                         "docstring with an Args: section)") from None


def make_tools(functions: Sequence[Callable[..., Any] | str], timeout: float = 10.0) -> dict[str, Tool]:
    """Tools by name; two tools of one name are an error."""
    tools: dict[str, Tool] = {}
    for function in functions:
        tool = function if isinstance(function, Tool) else Tool(function, timeout)
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools
