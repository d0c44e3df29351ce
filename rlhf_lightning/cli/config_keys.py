"""What the ``--config`` files say, for the lines about them: where a key sits (file and line of a dotted key such
as ``trainer.max_epoch`` or ``model.init_args.kl_coef`` that the parser refused), and which model arguments a class
switched on the command line dropped."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import yaml

from rlhf_lightning.utils.checks import GROUP_CLASSES

# A field of a typed group given null on the command line (`--model.init_args.kl.target=null`), which jsonargparse
# 4.53 refuses inside a class's init_args ("expected a number or null, got None"), though it takes the same as a
# dict: `--model.init_args.kl={target: null}`, merged into the group like any other value.
GROUP_FIELD = re.compile(rf"^--((?:\w+\.)*init_args\.(?:{'|'.join(GROUP_CLASSES)}))\.(\w+)(?:=(.*))?$")
NULLS = frozenset({"null", "none", "~"})


def takes_the_word_none(group: str, field: str) -> bool:
    """Whether ``group.field`` has the string ``"none"`` among its values (``correction.mode: none``): there the
    word is the value, not null."""
    import rlhf_lightning

    cls = getattr(rlhf_lightning, GROUP_CLASSES[group])
    hint = typing.get_type_hints(cls).get(field)
    pending, seen = [hint], []
    while pending:
        current = pending.pop()
        seen.append(current)
        pending += list(typing.get_args(current))
    return "none" in seen


def nulls_in_groups(argv: list[str]) -> list[str]:
    """``argv`` with every ``--<...>.init_args.<group>.<field>=null`` (or ``... null``) given as
    ``--<...>.init_args.<group>={<field>: null}``; ``none`` too, unless the field takes the word."""
    out: list[str] = []
    index = 0
    while index < len(argv):
        match = GROUP_FIELD.match(argv[index])
        value = None if match is None else match.group(3)
        separate = match is not None and value is None and index + 1 < len(argv)
        if separate:
            value = argv[index + 1]
        word = None if value is None else value.strip().lower()
        group = None if match is None else match.group(1).rsplit(".", 1)[-1]
        if (match is not None and word in NULLS
                and not (word == "none" and takes_the_word_none(group, match.group(2)))):
            out.append(f"--{match.group(1)}={{{match.group(2)}: null}}")
            index += 2 if separate else 1
            continue
        out.append(argv[index])
        index += 1
    return out


# jsonargparse's words for a key of a config file that no argument takes: in a fit, and in --print_config (which
# checks the config group by group).
NOT_ACCEPTED = re.compile(r"^Subcommand '(\w+)' does not accept (?:option|nested key) '([\w.]+)'")
NOT_ACCEPTED_IN_GROUP = re.compile(r"^Group '([\w.]+)' does not accept (?:option|nested key) '([\w.]+)'")


def key_line(path: str, dotted: str) -> int | None:
    """The line (1-based) where ``dotted`` is set in the YAML file ``path`` (a
    :class:`~rlhf_lightning.cli.errors.ConfigFile` is read where it pointed when the command started), or None."""
    try:
        node = yaml.compose(Path(getattr(path, "absolute", path)).read_text())
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


# The dotted key a one-line error opens with: `model.init_args.kl_coef: ...`, `model.class_path my.Cls: ...`.
LEADING_KEY = re.compile(r"^(\w+(?:\.\w+)+)[:\s]")


def located(line: str, files: list[str], argv: list[str]) -> str:
    """``line`` with ``FILE:LINE: `` before it where it opens with a key that one of the config ``files`` sets and
    the command line (``argv``) does not touch: a value given on the command line (``--model.init_args.kl.coef``,
    ``--model.init_args.kl={...}``, ``--model OtherClass``) wins over the file's, so the file's line would point at
    the wrong value."""
    match = LEADING_KEY.match(line)
    if match is None:
        return line
    key = match.group(1)
    given = (argument[2:].split("=", 1)[0] for argument in argv if argument.startswith("--"))
    if any(f"{key}.".startswith(f"{name}.") or f"{name}.".startswith(f"{key}.") for name in given):
        return line
    where = key_location(files, key)
    return f"{where}: {line}" if where else line


def not_accepted_line(message: str, options: list[str], suggest) -> str | None:  # noqa: ANN001
    """The one line for a key no argument takes, with the closest accepted names (``suggest(name, accepted)``);
    None for another message. :func:`located` puts its file and line before it."""
    match = NOT_ACCEPTED.match(message)
    in_group = NOT_ACCEPTED_IN_GROUP.match(message) if match is None else None
    if match is None and in_group is None:
        return None
    key, where = (match.group(2), match.group(1)) if match else (f"{in_group.group(1)}.{in_group.group(2)}", None)
    accepted = list(dict.fromkeys(option.removeprefix("--") for option in options if option.startswith("--")))
    return f"{key}: no such option{f' of {where}' if where else ''}{suggest(key, accepted)}"


def merged_model_section(files: list[str]) -> tuple[str | None, dict[str, object]]:
    """The ``model`` section the ``--config`` files give, later files over earlier ones: its ``class_path`` and
    ``init_args`` (a class path given without ``init_args`` keeps the earlier arguments, as jsonargparse does)."""
    class_path, init_args = None, {}
    for path in files:
        try:
            data = yaml.safe_load(Path(getattr(path, "absolute", path)).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        model = data.get("model") if isinstance(data, dict) else None
        if isinstance(model, dict):
            class_path = model.get("class_path", class_path)
            init_args = {**init_args, **(model.get("init_args") or {})}
    return class_path, init_args


def dropped_model_arguments(files: list[str], class_path: str, init_args: list[str]) -> str | None:
    """A warning when the model's class was switched away from the config file's (``--model OtherClass``) and
    arguments the file gives are not the new class's (``init_args``: the names it kept, dotted for nested ones):
    jsonargparse drops them without a word."""
    file_class, file_args = merged_model_section(files)
    if file_class is None or file_class == class_path:
        return None
    kept = {str(name).split(".")[0] for name in init_args}
    dropped = sorted(name for name in file_args if name not in kept)
    for name in sorted(kept & file_args.keys()):  # an argument both take, whose fields differ (an estimator's)
        given = file_args[name]
        if not isinstance(given, dict):
            continue
        fields = (given.get("init_args") or {}) if "class_path" in given else given
        taken = {str(key).removeprefix(f"{name}.").removeprefix("init_args.").split(".")[0]
                 for key in init_args if str(key).startswith(f"{name}.")}
        dropped += [f"{name}.{field}" for field in fields if field not in taken]
    if not dropped:
        return None
    return (f"model.class_path {class_path} replaces the config's {file_class}: its init_args "
            f"{', '.join(dropped)} {'are not arguments' if len(dropped) > 1 else 'is not an argument'} of "
            f"{class_path.rsplit('.', 1)[-1]} and {'were' if len(dropped) > 1 else 'was'} dropped")
