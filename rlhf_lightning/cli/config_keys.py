"""Where a key of the config sits: the file and line of a dotted key (``trainer.max_epoch``) among the ``--config``
files, for an error that names a key the parser refused."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

# jsonargparse's words for a key of a config file that no argument takes.
NOT_ACCEPTED = re.compile(r"^Subcommand '(\w+)' does not accept (?:option|nested key) '([\w.]+)'")


def key_line(path: str, dotted: str) -> int | None:
    """The line (1-based) where ``dotted`` is set in the YAML file ``path``, or None."""
    try:
        node = yaml.compose(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        found = next(((key, value) for key, value in node.value if getattr(key, "value", None) == part), None)
        if found is None:
            return None
        line, node = found[0].start_mark.line + 1, found[1]
    return line


def key_location(files: list[str], dotted: str) -> str | None:
    """``FILE:LINE`` of the last of ``files`` that sets ``dotted`` (a later file wins), or None."""
    for path in reversed(files):
        line = key_line(path, dotted)
        if line is not None:
            return f"{path}:{line}"
    return None


def not_accepted_line(message: str, options: list[str], files: list[str], suggest) -> str | None:  # noqa: ANN001
    """The one line for a key no argument takes: where it is (file and line, when a config file sets it) and the
    closest accepted names (``suggest(name, accepted)``); None for another message."""
    match = NOT_ACCEPTED.match(message)
    if match is None:
        return None
    key = match.group(2)
    where = key_location(files, key)
    accepted = list(dict.fromkeys(option.removeprefix("--") for option in options if option.startswith("--")))
    return (f"{where + ': ' if where else ''}{key}: no such option of {match.group(1)}"
            f"{suggest(key, accepted)}")
