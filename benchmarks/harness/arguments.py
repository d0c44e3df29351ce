"""The command line of the side-by-side scripts: the options they share, the dry run and the choice of sides."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from typing import Any

from .settings import PRESETS

# What --dry-run sets in every script (beside each script's own sizes): the tiny preset, one process per side,
# one measured iteration and no warm-up.
DRY_RUN = {"preset": "tiny", "iterations": 1, "warmup": 0, "repeats": 1}


def add_common_arguments(parser: argparse.ArgumentParser, iterations: int, unit: str,
                         precisions: tuple[str, ...] = ("32", "bf16-mixed"),
                         profile_sides: tuple[str, ...] = ("ours",)) -> None:
    """The options every side-by-side benchmark shares (``unit``: what one measured iteration is;
    ``profile_sides``: the sides ``--profile`` can profile)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--precision", choices=precisions, default="32",
                        help="Lightning's precision; bf16-true (where offered): our base in bf16 weights, ours only")
    parser.add_argument("--iterations", type=int, default=iterations, help=f"measured {unit} per process")
    parser.add_argument("--warmup", type=int, default=1, help=f"unmeasured {unit} first, per process")
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds of fresh processes")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process; 0 = torch's default")
    parser.add_argument("--mmap-threshold", type=int, default=0,
                        help="set glibc's MALLOC_MMAP_THRESHOLD_ (bytes) in every side's process, e.g. 1048576: "
                             "large tensors are then returned to the OS when freed instead of fragmenting the "
                             "heap; 0 = the allocator's default")
    parser.add_argument("--workdir", default=None, help="folder for the model and logs (default: a temp dir)")
    parser.add_argument("--profile", nargs="?", const="ours", default=None, choices=profile_sides, metavar="SIDE",
                        help=f"print torch.profiler's top operators of SIDE's last measured {unit.rstrip('s')} (first "
                             f"round; SIDE: {', '.join(profile_sides)}; default ours); its time then includes the "
                             "profiler's overhead")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings", default=None, help=argparse.SUPPRESS)


def add_dry_run_argument(parser: argparse.ArgumentParser, values: dict[str, Any]) -> None:
    """``--dry-run``: every side asked for runs for real, at the tiny shape ``values`` (option name: value), to
    check that the script works, not to measure it; see :func:`parse_with_dry_run`."""
    shown = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in values.items())
    parser.add_argument("--dry-run", action="store_true",
                        help=f"check that the script runs: the whole pipeline at a tiny shape ({shown}; an option "
                             "given on the command line wins)")


def parse_with_dry_run(parser: argparse.ArgumentParser, argv: list[str] | None,
                       values: dict[str, Any]) -> argparse.Namespace:
    """``parser.parse_args(argv)``; under ``--dry-run``, each option of ``values`` still at its default (not given
    on the command line) takes the dry run's value."""
    args = parser.parse_args(argv)
    if args.dry_run:
        defaults = {action.dest: action.default for action in parser._actions}
        for name, value in values.items():
            if getattr(args, name) == defaults[name]:
                setattr(args, name, value)
    return args


def common_settings(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The :class:`~harness.settings.Settings` fields of :func:`add_common_arguments`' options (a temp workdir
    ``<prefix>-bench-*`` when none is given; LoRA's alpha = 2 r)."""
    return {"preset": args.preset, "precision": args.precision, "iterations": args.iterations,
            "warmup": args.warmup, "repeats": args.repeats, "lora_r": args.lora_r, "lora_alpha": 2.0 * args.lora_r,
            "device": args.device, "threads": args.threads, "mmap_threshold": args.mmap_threshold,
            "workdir": args.workdir or tempfile.mkdtemp(prefix=f"{prefix}-bench-")}


def side_order(requested: str, sides: Sequence[str], floor_pieces: Sequence[str] = ()) -> list[str]:
    """The processes of one round: the requested ``sides`` (comma-separated) in ``sides`` order, then each floor
    piece (``floor/<piece>``) when ``floor`` is requested (a benchmark with ``floor_pieces``); an unknown side is
    a clear error."""
    asked = requested.split(",")
    known = [*sides, "floor"] if floor_pieces else list(sides)
    unknown = set(asked) - set(known)
    if unknown:
        raise SystemExit(f"unknown sides {sorted(unknown)}; choose from {','.join(known)}")
    return [side for side in sides if side in asked] + (
        [f"floor/{piece}" for piece in floor_pieces] if "floor" in asked else [])
