"""The ``pyshmckpt`` command line (also ``python -m pyshmckpt``): demo, bench, gc, verify, inspect,
cuda-info."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointCorruptError, NotSupportedError, ObjectStoreError
from ..shm import stale


def _gc(args: argparse.Namespace) -> int:
    from ..tiers import records

    for path in records.collect_stale(args.prefix, dry_run=args.dry_run):
        print(
            f"{'would remove' if args.dry_run else 'removed':12s} {path.name}: its holder is gone"
        )
    for path, record in records.holds(args.prefix):
        if record.get("pending"):  # the writer still finishes its saves: gc again once it holds
            print(f"{'kept':12s} {path.name}: its writer is still finishing {record.get('name')}")
            continue
        if not args.dry_run:
            records.release(path, record)
        print(
            f"{'would free' if args.dry_run else 'freed':12s} "
            f"{'replica' if record.get('replica') else 'checkpoint'} {record.get('name')} "
            f"(rank {record.get('rank')} of {record.get('root')}) held in memory by pid "
            f"{(record.get('holder') or ['?'])[0]}"
        )
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
    """Report a corrupt checkpoint, or one this pyshmckpt cannot read (a newer format), as one
    line on stderr and exit status 1."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except CheckpointCorruptError as exc:
            print(f"CORRUPT: {exc}", file=sys.stderr)
            return 1
        except NotSupportedError as exc:
            print(f"NOT SUPPORTED: {exc}", file=sys.stderr)
            return 1
        except ObjectStoreError as exc:
            print(f"OBJECT STORAGE: {exc}", file=sys.stderr)
            return 1

    return wrapped


@_checked
def _verify(args: argparse.Namespace) -> int:
    from ..storage.inspection import pinned, saved_ranks, verify

    path = pinned(args.path)
    checked = [args.rank] if args.rank is not None else saved_ranks(path)
    counts = [verify(path, rank=rank) for rank in checked]
    where = f"rank {checked[0]}" if len(checked) == 1 else f"{len(checked)} ranks"
    print(f"OK: {args.path}: {sum(counts)} tensors ({where}), every checksum matches")
    return 0


def _print_tiers(root: str) -> bool:
    """The checkpoints of a root on disk and held in memory; False when there are none."""
    import os
    from pathlib import Path

    from ..storage import commit
    from ..tiers import records

    on_disk = [name for _, name in commit.committed(Path(root))] if Path(root).is_dir() else []
    real = os.path.realpath(root)
    in_memory = [(p, r) for p, r in records.holds() if r.get("root") == real]
    for name in on_disk:
        print(f"on disk    {name}")
    for path, record in sorted(
        in_memory, key=lambda pr: (pr[1].get("rank", 0), pr[1].get("name", ""))
    ):
        alive = "alive" if records.holder_alive(path) else "gone"
        where = "replica   " if record.get("replica") else "in memory "
        print(
            f"{where} {record.get('name')}  rank {record.get('rank')}  "
            f"{int(record.get('data_bytes', 0)) / 2**20:.1f} MiB  held by pid "
            f"{(record.get('holder') or ['?'])[0]} ({alive})"
            + ("" if record.get("persisted") else ", not on disk")
            + (
                ", its writer still finishing the dead trainer's saves"
                if record.get("pending")
                else ""
            )
            + (", a copy of another node's rank" if record.get("replica") else "")
        )
    if on_disk or in_memory:
        print()
    return bool(on_disk)


def _print_stored(url: str) -> bool:
    """The committed checkpoints of a root in object storage (none for a checkpoint's own URL);
    False when the URL holds nothing committed."""
    from ..storage import object_commit, object_store

    where = object_store.parse(url)
    if object_commit.record_of(where) is not None:
        return True
    stored = [name for _, name in object_commit.committed(where)]
    for name in stored:
        print(f"in storage {name}")
    if stored:
        print()
    return bool(stored)


@_checked
def _inspect(args: argparse.Namespace) -> int:
    from ..storage import object_store
    from ..storage.inspection import describe, pinned, saved_ranks
    from ..tiers.restore import is_root

    if object_store.is_url(args.path):
        if not _print_stored(args.path):
            return 0  # nothing committed to describe
    elif is_root(args.path) and not _print_tiers(args.path):
        return 0  # nothing on disk to describe

    if args.rank is not None:
        _print_rows(describe(pinned(args.path), rank=args.rank))
        return 0
    path = pinned(args.path)
    per_rank = {rank: describe(path, rank=rank) for rank in saved_ranks(path)}
    if not any(row["dtensor"] is not None for rows in per_rank.values() for row in rows):
        _print_rows(per_rank[min(per_rank)])  # nothing sharded: every rank is read alike
        return 0
    _print_sharded(per_rank)
    return 0


def _print_rows(rows: list[dict[str, Any]]) -> None:
    width = max([len(r["name"]) for r in rows] + [6])
    print(f"{'tensor':{width}s}  {'dtype':14s} {'shape':22s} {'bytes':>14s}  stored as")
    total = 0
    for r in rows:
        total += r["nbytes"]
        print(
            f"{r['name']:{width}s}  {r['dtype']:14s} {str(tuple(r['shape'])):22s} {r['nbytes']:14,d}  {r['entry']}"
        )
    print(f"{len(rows)} tensors, {total:,d} bytes")


def _print_sharded(per_rank: dict[int, list[dict[str, Any]]]) -> None:
    """Each tensor once: its global shape, placements, and which ranks hold which part."""
    names: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for rank, rows in per_rank.items():
        for row in rows:
            names.setdefault(row["name"], []).append((rank, row))
    total = 0
    for name, held in names.items():
        first = held[0][1]
        info = first["dtensor"]
        total += sum(row["nbytes"] for _, row in held)
        if info is None:
            where = "every rank" if len(held) == len(per_rank) else _rank_list(held)
            print(f"{name}  {first['dtype']} {tuple(first['shape'])}  plain, on {where}")
            continue
        placements = ", ".join(_placement_text(p) for p in info.placements)
        print(
            f"{name}  {first['dtype']} global {info.global_shape}  mesh {info.mesh_shape} "
            f"[{placements}]"
        )
        for rank, row in held:
            part = row["dtensor"]
            box = ", ".join(
                f"{o}:{o + s}" for o, s in zip(part.global_offset, part.local_shape, strict=True)
            )
            print(f"    rank {rank}: [{box}]  {row['nbytes']:,d} bytes")
    print(f"{len(names)} tensors on {len(per_rank)} ranks, {total:,d} bytes in all")


def _placement_text(placement: tuple[Any, ...]) -> str:
    kind, *args = placement
    name = {"shard": "Shard", "replicate": "Replicate", "partial": "Partial"}.get(kind, kind)
    return f"{name}({', '.join(str(a) for a in args)})"


def _rank_list(held: list[tuple[int, dict[str, Any]]]) -> str:
    return "ranks " + ", ".join(str(rank) for rank, _ in held)


def _demo(args: argparse.Namespace) -> int:
    from .demo import options

    options.check(args)  # a bad flag exits 2 before torch is imported
    from .demo import run

    return run.main(args)


def _cuda_info(args: argparse.Namespace) -> int:
    """Exit status 0 when CUDA tensors can be staged here, 1 when not (with the reason)."""
    from ..shm.cuda import cuda_info

    info = cuda_info()
    print("\n".join(info.lines()))
    return 0 if info.usable else 1


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
    args = build_parser().parse_args(argv)
    return int(args.run(args))


def build_parser() -> argparse.ArgumentParser:
    """The ``pyshmckpt`` parser, one subcommand per command (each sets ``run``). Building it
    imports neither torch nor the demo's run."""
    from . import bench
    from .demo import options as demo_options

    parser = argparse.ArgumentParser(prog="pyshmckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser(
        "demo",
        help="train a small GPT, checkpoint it through pyshmckpt and through torch's transport, compare",
    )
    demo_options.add_arguments(demo_parser)
    demo_parser.set_defaults(run=_demo)
    bench_parser = sub.add_parser(
        "bench", help="run the benchmark suite (bench/), print the comparison, write JSON and plots"
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=_bench)
    gc = sub.add_parser(
        "gc",
        help="free every checkpoint and replica this user holds in memory, then remove hold "
        "records whose holder is gone and shared-memory segments no process has open",
    )
    gc.add_argument(
        "--prefix",
        default=None,
        help="segment name prefix (default: PYSHMCKPT_SEGMENT_PREFIX or pyshmckpt)",
    )
    gc.add_argument(
        "--dry-run", action="store_true", help="only list what would be freed or removed"
    )
    gc.set_defaults(run=_gc)
    verify = sub.add_parser(
        "verify", help="check a checkpoint's checksums and structure (exit 1 if corrupt)"
    )
    verify.add_argument(
        "path",
        help="a checkpoint directory, or a root (its latest); or an s3:// or gs:// URL of either",
    )
    verify.add_argument(
        "--rank", type=int, default=None, help="check only this rank (default: every rank)"
    )
    verify.set_defaults(run=_verify)
    inspect = sub.add_parser(
        "inspect",
        help="list a checkpoint's tensors, dtypes, shapes and bytes (for a root: first its "
        "checkpoints on disk and held in memory)",
    )
    inspect.add_argument(
        "path",
        help="a checkpoint directory, or a root (its latest); or an s3:// or gs:// URL of either",
    )
    inspect.add_argument(
        "--rank",
        type=int,
        default=None,
        help="list this rank's tensors (default: every rank's, sharded tensors with their parts)",
    )
    inspect.set_defaults(run=_inspect)
    cuda_info = sub.add_parser(
        "cuda-info",
        help="say whether CUDA staging works here: the driver loaded and from where, its version, "
        "the devices, pinning a test buffer; the reason when not (exit 1)",
    )
    cuda_info.set_defaults(run=_cuda_info)
    return parser
