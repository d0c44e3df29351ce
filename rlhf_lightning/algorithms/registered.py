"""Families of loss classes that a config names: a family's base holds a ``registry`` (class name -> class) that
each subclass joins when it is defined.

A config names a family member by class name (``policy_loss: CISPO``, ``preference_loss: IPO``) or by import path (one of
your own). A class of yours that takes the name of one we ship is refused when it is defined: a config naming it
would be ambiguous, and one of the two would silently stand in for the other.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

PACKAGE = "rlhf_lightning."


class Registered:
    """Base of a family's base: set ``registry = {}`` and ``family`` (its name in messages) on the family's base;
    its subclasses register themselves. Members compare and print by their arguments (the instance's attributes),
    as a config and a checkpoint's hyper-parameters show them."""

    registry: ClassVar[dict[str, type]]
    family: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "registry" in vars(cls):  # a family's base, not a member
            return
        taken = cls.registry.get(cls.__name__)
        if (taken is not None and taken.__module__ != cls.__module__ and taken.__module__.startswith(PACKAGE)
                and not cls.__module__.startswith(PACKAGE)):
            raise TypeError(f"{cls.__module__}.{cls.__name__}: {cls.__name__} is the name of rlhf_lightning's "
                            f"{cls.family} {taken.__module__}.{taken.__name__}; give yours another name (a config "
                            f"naming {cls.__name__} would be ambiguous)")
        cls.registry[cls.__name__] = cls
        # Checkpoints hold the member in their hyper-parameters: `torch.load(weights_only=True)` (the default when
        # Lightning resumes) must be allowed to rebuild it.
        torch.serialization.add_safe_globals([cls])

    @classmethod
    def require(cls, argument: str, value: object) -> None:
        """Refuse, in one line, a value of ``argument`` that is not a member of this family."""
        if not isinstance(value, cls):
            raise TypeError(f"{argument} must be a {cls.__name__} (one of {', '.join(cls.registry)}, or a subclass of "
                            f"your own), got {value!r}")

    def __repr__(self) -> str:
        arguments = ", ".join(f"{name}={value!r}" for name, value in vars(self).items())
        return f"{type(self).__name__}({arguments})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]
