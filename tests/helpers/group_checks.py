"""What every argument group's ``check`` promises: a bad field's one-line error names ``group.field``, and the name
``check`` is given prefixes the field instead."""

from __future__ import annotations

from typing import Any

import pytest


def assert_check_names_the_field(settings: Any, message: str, group: str, other_name: str = "settings") -> None:
    """``settings.check()`` raises ``message`` (which names ``group.field``), ``settings.check(other_name)`` the
    same with ``other_name.field`` for every field it names."""
    with pytest.raises(ValueError) as error:
        settings.check()
    assert str(error.value) == message
    with pytest.raises(ValueError) as error:
        settings.check(other_name)
    assert str(error.value) == message.replace(f"{group}.", f"{other_name}.")
