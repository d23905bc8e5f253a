"""The ``pyshmckpt`` command line (also ``python -m pyshmckpt``): demo, bench, gc, verify, inspect."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..errors import CheckpointCorruptError
from ..shm import stale


def _gc(args: argparse.Namespace) -> int:
    segments = stale.list_segments(args.prefix)
    removed = stale.collect_stale_segments(args.prefix, dry_run=args.dry_run)
    removed_names = {info.name for info in removed}
    verb = "would remove" if args.dry_run else "removed"
    for info in segments:
        action = verb if info.name in removed_names else "kept"
        print(
            f"{action:12s} {info.name}  {info.size / 2**20:10.1f} MiB  owner {info.owner_pid}: {info.reason}"
        )
    print(f"{len(removed)} stale segment(s) {verb}, {len(segments) - len(removed)} in use")
    return 0


def _checked(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Report a corrupt checkpoint as one line on stderr and exit status 1."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except CheckpointCorruptError as exc:
            print(f"CORRUPT: {exc}", file=sys.stderr)
            return 1

    return wrapped


@_checked
def _verify(args: argparse.Namespace) -> int:
    from ..storage.reader import ranks, verify

    checked = [args.rank] if args.rank is not None else ranks(args.path)
    counts = [verify(args.path, rank=rank) for rank in checked]
    where = f"rank {checked[0]}" if len(checked) == 1 else f"{len(checked)} ranks"
    print(f"OK: {args.path}: {sum(counts)} tensors ({where}), every checksum matches")
    return 0


@_checked
def _inspect(args: argparse.Namespace) -> int:
    from ..storage.reader import describe

    rows = describe(args.path, rank=args.rank)
    width = max([len(r["name"]) for r in rows] + [6])
    print(f"{'tensor':{width}s}  {'dtype':14s} {'shape':22s} {'bytes':>14s}  stored as")
    total = 0
    for r in rows:
        total += r["nbytes"]
        print(
            f"{r['name']:{width}s}  {r['dtype']:14s} {str(tuple(r['shape'])):22s} {r['nbytes']:14,d}  {r['entry']}"
        )
    print(f"{len(rows)} tensors, {total:,d} bytes")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run.main(args)


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(args)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    from . import bench
    from .demo import run as demo

    parser = argparse.ArgumentParser(prog="pyshmckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser(
        "demo",
        help="train a small GPT, checkpoint it through pyshmckpt and through torch's transport, compare",
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=_demo)
    bench_parser = sub.add_parser(
        "bench", help="run the benchmark suite (bench/), print the comparison, write JSON and plots"
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=_bench)
    gc = sub.add_parser("gc", help="remove shared-memory segments whose owner process is gone")
    gc.add_argument(
        "--prefix",
        default=None,
        help="segment name prefix (default: PYSHMCKPT_SEGMENT_PREFIX or pyshmckpt)",
    )
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    gc.set_defaults(run=_gc)
    verify = sub.add_parser(
        "verify", help="check a checkpoint's checksums and structure (exit 1 if corrupt)"
    )
    verify.add_argument("path", help="a checkpoint directory, or a root (its latest)")
    verify.add_argument(
        "--rank", type=int, default=None, help="check only this rank (default: every rank)"
    )
    verify.set_defaults(run=_verify)
    inspect = sub.add_parser(
        "inspect", help="list a checkpoint's tensors, dtypes, shapes and bytes"
    )
    inspect.add_argument("path", help="a checkpoint directory, or a root (its latest)")
    inspect.add_argument("--rank", type=int, default=0)
    inspect.set_defaults(run=_inspect)
    args = parser.parse_args(argv)
    return int(args.run(args))
