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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pyshmckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gc = sub.add_parser("gc", help="remove shared-memory segments whose owner process is gone")
    gc.add_argument("--prefix", default=None, help="segment name prefix (default: PYSHMCKPT_SEGMENT_PREFIX or pyshmckpt)")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    gc.set_defaults(run=_gc)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
