"""``python -m rlhf_lightning merge``: fold a LoRA adapter into its base and write a standalone model, with a model
card that says what was merged."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from rlhf_lightning.cli.model_card import CARD, merge_card
from rlhf_lightning.models.adapter_files import adapter_base, recorded_base
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.utils.file_modes import readable_as_umask_allows


def merge_adapter(adapter: str | Path, out: str | Path, base: str | None = None,
                  argv: Sequence[str] | None = None) -> Path:
    """Write ``base`` with the adapter in ``adapter`` merged in, plus the tokenizer and a model card, as a
    transformers folder; returns it.

    ``base`` defaults to the base model recorded in the adapter's ``adapter_config.json``; ``argv``: the command's
    arguments for the card (default: ``merge --adapter ADAPTER --out OUT``, with ``--base`` when given).
    """
    adapter = Path(adapter)
    recorded = recorded_base(adapter)  # checks that the folder is an adapter
    if argv is None:
        argv = ["merge", "--adapter", str(adapter), "--out", str(out),
                *(["--base", base] if base is not None and base != recorded else [])]
    base = adapter_base(adapter, base)  # the recorded base when none is given
    spec = BaseModelSpec(name_or_path=base)
    tokenizer = load_tokenizer(spec)
    shared = SharedBase(load_causal_lm(spec, tokenizer))
    shared.load_adapter(adapter, "merged")
    folder = shared.save_merged("merged", out, tokenizer)
    (folder / CARD).write_text(merge_card(adapter, base, argv))
    readable_as_umask_allows(folder)
    return folder


def main(args: Sequence[str]) -> None:
    """``python -m rlhf_lightning merge --adapter ADAPTER --out OUT [--base BASE]``: print the merged folder."""
    parser = argparse.ArgumentParser(prog="python -m rlhf_lightning merge", description=__doc__)
    parser.add_argument("--adapter", required=True, help="peft adapter folder, e.g. outputs/ppo/adapters/policy")
    parser.add_argument("--out", required=True, help="folder for the merged transformers model")
    parser.add_argument("--base", default=None, help="base model (default: the adapter's recorded base)")
    options = parser.parse_args(list(args))
    print(merge_adapter(options.adapter, options.out, options.base, ["merge", *args]))
