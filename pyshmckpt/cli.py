"""The ``pyshmckpt`` command line (also ``python -m pyshmckpt``)."""

from __future__ import annotations

import argparse
import sys

from . import stale


def _gc(args: argparse.Namespace) -> int:
    segments = stale.list_segments(args.prefix)
    removed = stale.collect_stale_segments(args.prefix, dry_run=args.dry_run)
    removed_names = {info.name for info in removed}
    verb = "would remove" if args.dry_run else "removed"
    for info in segments:
        action = verb if info.name in removed_names else "kept"
        print(f"{action:12s} {info.name}  {info.size / 2**20:10.1f} MiB  owner {info.owner_pid}: {info.reason}")
    print(f"{len(removed)} stale segment(s) {verb}, {len(segments) - len(removed)} in use")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .errors import CheckpointCorruptError
    from .reader import verify

    try:
        count = verify(args.path, rank=args.rank)
    except CheckpointCorruptError as exc:
        print(f"CORRUPT: {exc}", file=sys.stderr)
        return 1
    print(f"OK: {args.path}: {count} tensors, every checksum matches")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .errors import CheckpointCorruptError
    from .reader import describe

    try:
        rows = describe(args.path, rank=args.rank)
    except CheckpointCorruptError as exc:
        print(f"CORRUPT: {exc}", file=sys.stderr)
        return 1
    width = max([len(r["name"]) for r in rows] + [6])
    print(f"{'tensor':{width}s}  {'dtype':14s} {'shape':22s} {'bytes':>14s}  stored as")
    total = 0
    for r in rows:
        total += r["nbytes"]
        print(f"{r['name']:{width}s}  {r['dtype']:14s} {str(tuple(r['shape'])):22s} {r['nbytes']:14,d}  {r['entry']}")
    print(f"{len(rows)} tensors, {total:,d} bytes")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pyshmckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gc = sub.add_parser("gc", help="remove shared-memory segments whose owner process is gone")
    gc.add_argument("--prefix", default=None, help="segment name prefix (default: PYSHMCKPT_SEGMENT_PREFIX or pyshmckpt)")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    gc.set_defaults(run=_gc)
    verify = sub.add_parser("verify", help="check a checkpoint's checksums and structure (exit 1 if corrupt)")
    verify.add_argument("path", help="a checkpoint directory, or a root (its latest)")
    verify.add_argument("--rank", type=int, default=0)
    verify.set_defaults(run=_verify)
    inspect = sub.add_parser("inspect", help="list a checkpoint's tensors, dtypes, shapes and bytes")
    inspect.add_argument("path", help="a checkpoint directory, or a root (its latest)")
    inspect.add_argument("--rank", type=int, default=0)
    inspect.set_defaults(run=_inspect)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
