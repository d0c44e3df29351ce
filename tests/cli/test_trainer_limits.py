"""``--trainer.limit_train_batches=1`` is one batch whatever typing's cache held when Lightning was imported."""

from __future__ import annotations

import inspect
import typing

from jsonargparse import ArgumentParser
from lightning.pytorch import Trainer

from rlhf_lightning.cli.trainer_limits import int_first_trainer_limits

LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches")


def parsed_limit(value: str) -> object:
    parser = ArgumentParser()
    parser.add_class_arguments(Trainer, "trainer")
    return parser.parse_args([f"--trainer.limit_train_batches={value}"]).trainer.limit_train_batches


def test_the_trainers_batch_limits_read_an_int_as_a_count(monkeypatch):
    # As Lightning is when Fabric's `Optional[Union[float, int]]` was built first (typing hands it to the Trainer too).
    float_first = typing._UnionGenericAlias(typing.Union, (float, int, type(None)))  # built apart from the cache
    annotations = Trainer.__init__.__annotations__  # the one dict of __init__ and of the function it wraps
    assert annotations is inspect.unwrap(Trainer.__init__).__annotations__
    for name in LIMITS:
        monkeypatch.setitem(annotations, name, float_first)
    for clear in typing._cleanups:  # and typing's cache holding the float-first unions, as after Fabric's import
        clear()
    typing.Optional[typing.Union[float, int]]  # noqa: B018, UP007, UP045 - Fabric's clip_val, built first
    assert typing.Optional[typing.Union[int, float]].__args__ == (float, int, type(None))  # noqa: UP007, UP045 (typing's own union, whose cache is the point)
    # (parsed now, `1` would be 1.0, every batch; jsonargparse then keeps the signature it read, so it is not parsed
    # before the fix)
    assert set(int_first_trainer_limits()) >= set(LIMITS)
    assert all(Trainer.__init__.__annotations__[name].__args__ == (int, float, type(None)) for name in LIMITS)
    assert parsed_limit("1") == 1 and isinstance(parsed_limit("1"), int)  # one batch
    assert parsed_limit("0.25") == 0.25
    assert int_first_trainer_limits() == []  # already int first: nothing to do
