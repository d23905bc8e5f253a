"""The ``demo`` subcommand's flags and their checks, apart from its run (`run`): building the
command line and rejecting a bad flag do not import torch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...shm import cuda_available


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's flags to `parser` (the ``demo`` subcommand's parser)."""
    parser.description = (
        "Train a small GPT with AdamW and checkpoint it every --interval steps through pyshmckpt "
        "(ShmStager + CheckpointProcess + SafetensorsWriter) and through torch's _experimental "
        "transport (DefaultStager + CheckpointProcess + CheckpointWriter), one after the other; "
        "print blocked time, time until durable, throughput and peak shared memory of each; then "
        "restore the last checkpoint of each into a fresh model and optimizer and check that it "
        "is bit-exact and resumes training exactly."
    )
    model = parser.add_argument_group(
        "model (the defaults make ~290 MB of state: many parameters, little compute)"
    )
    model.add_argument(
        "--layers", type=_positive_int, default=10, help="transformer blocks (default 10)"
    )
    model.add_argument(
        "--width", type=_positive_int, default=384, help="embedding width (default 384)"
    )
    model.add_argument(
        "--heads",
        type=_positive_int,
        default=6,
        help="attention heads; must divide --width (default 6)",
    )
    model.add_argument(
        "--vocab", type=_positive_int, default=16384, help="vocabulary size (default 16384)"
    )
    model.add_argument(
        "--seq-len", type=_positive_int, default=32, help="tokens per sequence (default 32)"
    )
    model.add_argument(
        "--batch-size", type=_positive_int, default=4, help="sequences per step (default 4)"
    )
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=_positive_int, default=50, help="training steps (default 50)")
    run.add_argument(
        "--interval", type=_positive_int, default=10,
        help="checkpoint every N steps, and at the last step (default 10)",
    )  # fmt: skip
    run.add_argument(
        "--keep", type=_positive_int, default=2,
        help="checkpoints kept per transport; older ones are deleted between checkpoints "
        "(default 2)",
    )  # fmt: skip
    run.add_argument(
        "--slots", type=_positive_int, default=1,
        help="shared-memory slots of pyshmckpt's stager (default 1: the demo waits for each "
        "checkpoint; 2 lets training stage the next one while one is written)",
    )  # fmt: skip
    run.add_argument(
        "--direct-io", action=argparse.BooleanOptionalAction, default=True,
        help="pyshmckpt's writer writes tensor data with O_DIRECT where the filesystem allows it "
        "(default; --no-direct-io: through the page cache, like torch's writer)",
    )  # fmt: skip
    run.add_argument(
        "--output", metavar="DIR", default=None,
        help="directory for the checkpoints (kept; must be empty or not exist). Default: a "
        "temporary directory, removed at the end",
    )  # fmt: skip
    run.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="where to train (auto: CUDA when available to torch and pyshmckpt)",
    )  # fmt: skip
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model's initialization and the data (default 0)",
    )
    parser.set_defaults(demo_parser=parser)


def _usage_error(args: argparse.Namespace, message: str) -> None:
    """Exit with status 2 and `message`, the way argparse reports a bad flag."""
    parser = getattr(args, "demo_parser", None)
    if isinstance(parser, argparse.ArgumentParser):
        parser.error(message)  # raises SystemExit(2)
    print(f"pyshmckpt demo: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check(args: argparse.Namespace) -> None:
    """Checks that involve more than one flag, or the machine (argparse errors, exit status 2)."""
    if args.width % args.heads:
        _usage_error(args, f"--heads {args.heads} must divide --width {args.width}")
    if args.interval > args.steps:
        _usage_error(args, f"--interval {args.interval} is larger than --steps {args.steps}")
    if args.output is not None:
        out = Path(args.output)
        if out.exists() and not out.is_dir():
            _usage_error(args, f"--output {out} is not a directory")
        if out.is_dir() and any(out.iterdir()):
            _usage_error(args, f"--output {out} is not empty")
    if args.device == "cuda" and not cuda_available():
        _usage_error(
            args,
            "--device cuda: CUDA is not usable here (it needs a CUDA build of torch and a device; "
            "`pyshmckpt cuda-info` says what is missing)",
        )
