"""The command line of the side-by-side scripts: the options they share, the dry run and the choice of sides."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from typing import Any

from .lengths import LENGTHS
from .settings import PRESETS, WORKLOADS

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


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """``--lengths`` (how long the responses are, the same on every side) and ``--workload`` (a chat-like shape)."""
    parser.add_argument("--lengths", choices=LENGTHS, default="equal",
                        help="responses' lengths, the same row by row on every side: equal = stop token off, all "
                             "--response-length tokens (the published tables); task = the arithmetic task's "
                             "lengths scaled to --response-length; long-tail = lognormal, median --response-length/4, "
                             "the longest cut at --response-length (stop token on; see harness/lengths.py)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                        help="a chat-like shape: " + "; ".join(
                            f"{name} = " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())
                            for name, values in WORKLOADS.items()) + " (GRPO's group size only; an option given on "
                        "the command line wins, also under --dry-run)")


def add_dry_run_argument(parser: argparse.ArgumentParser, values: dict[str, Any]) -> None:
    """``--dry-run``: every side asked for runs for real, at the tiny shape ``values`` (option name: value), to
    check that the script works, not to measure it; see :func:`parse_with_dry_run`."""
    shown = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in values.items())
    parser.add_argument("--dry-run", action="store_true",
                        help=f"check that the script runs: the whole pipeline at a tiny shape ({shown}; an option "
                             "given on the command line wins)")


def parse_with_dry_run(parser: argparse.ArgumentParser, argv: list[str] | None,
                       values: dict[str, Any]) -> argparse.Namespace:
    """``parser.parse_args(argv)``; each option of the ``--workload`` (where the parser has one) still at its default
    (not given on the command line) takes the workload's value; then, under ``--dry-run``, each option of
    ``values`` still at its default takes the dry run's value."""
    args = parser.parse_args(argv)
    defaults = {action.dest: action.default for action in parser._actions}
    chosen = set()  # options given on the command line or by the workload: the dry run leaves them
    for name, value in WORKLOADS.get(getattr(args, "workload", None) or "", {}).items():
        if name in defaults and getattr(args, name) == defaults[name]:
            setattr(args, name, value)
            chosen.add(name)
    if getattr(args, "lengths", "equal") != "equal" and args.device.startswith("cuda"):
        parser.error(f"--lengths {args.lengths}: our side forces the planned stops in its eager decoder, and on CUDA "
                     "it decodes with the compiled one; measure realistic lengths on CPU for now")
    if args.dry_run:
        for name, value in values.items():
            if name not in chosen and getattr(args, name) == defaults[name]:
                setattr(args, name, value)
    return args


def common_settings(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The :class:`~harness.settings.Settings` fields of :func:`add_common_arguments`' options (a temp workdir
    ``<prefix>-bench-*`` when none is given; LoRA's alpha = 2 r)."""
    return {"preset": args.preset, "precision": args.precision, "iterations": args.iterations,
            "warmup": args.warmup, "repeats": args.repeats, "lora_r": args.lora_r, "lora_alpha": 2.0 * args.lora_r,
            "device": args.device, "threads": args.threads, "mmap_threshold": args.mmap_threshold,
            "lengths": getattr(args, "lengths", "equal"),
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
