"""Tunables, each with a documented environment override (read when the value is needed)."""

from __future__ import annotations

import os

from .errors import ConfigError

_MIB = 1 << 20


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw, 0)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be at least {minimum}")
    return value


def _env_float(name: str, default: float, minimum: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be at least {minimum}")
    return value


def slots() -> int:
    """PYSHMCKPT_SLOTS: slots per arena (default 2: stage step N+1 while step N is persisted)."""
    return _env_int("PYSHMCKPT_SLOTS", 2, 1)


def headroom() -> float:
    """PYSHMCKPT_HEADROOM: slot size over the first state dict's size when sizing (default 1.25)."""
    return _env_float("PYSHMCKPT_HEADROOM", 1.25, 1.0)


def alignment() -> int:
    """PYSHMCKPT_ALIGNMENT: byte alignment of every staged storage block (default 64)."""
    value = _env_int("PYSHMCKPT_ALIGNMENT", 64, 16)
    if value & (value - 1):
        raise ConfigError(f"PYSHMCKPT_ALIGNMENT={value} must be a power of two")
    return value


def slot_granularity() -> int:
    """PYSHMCKPT_SLOT_GRANULARITY: slot sizes are rounded up to this many bytes (default 2 MiB)."""
    return _env_int("PYSHMCKPT_SLOT_GRANULARITY", 2 * _MIB, 4096)


def pin_chunk_bytes() -> int:
    """PYSHMCKPT_PIN_CHUNK_BYTES: bytes per cuMemHostRegister call (default 1 GiB)."""
    return _env_int("PYSHMCKPT_PIN_CHUNK_BYTES", 1024 * _MIB, 4096)


def slot_timeout() -> float:
    """PYSHMCKPT_SLOT_TIMEOUT: seconds stage() waits for a busy slot to be freed (default 60)."""
    return _env_float("PYSHMCKPT_SLOT_TIMEOUT", 60.0, 0.0)


def device_copy_timeout() -> float:
    """PYSHMCKPT_DEVICE_COPY_TIMEOUT: seconds to wait for device-to-host copies (default 300)."""
    return _env_float("PYSHMCKPT_DEVICE_COPY_TIMEOUT", 300.0, 0.0)


def heartbeat_timeout() -> float:
    """PYSHMCKPT_HEARTBEAT_TIMEOUT: seconds without a heartbeat after which a rank's processes
    count as gone and a checkpoint the ranks write together is given up (default 10: ten missed
    beats, far beyond a scheduling delay on a busy node, yet a lost node costs seconds, not the
    barrier timeout)."""
    return _env_float("PYSHMCKPT_HEARTBEAT_TIMEOUT", 10.0, 1.0)


def segment_prefix() -> str:
    """PYSHMCKPT_SEGMENT_PREFIX: name prefix of our /dev/shm segments (default "pyshmckpt")."""
    prefix = os.environ.get("PYSHMCKPT_SEGMENT_PREFIX") or "pyshmckpt"
    if "/" in prefix:
        raise ConfigError(f"PYSHMCKPT_SEGMENT_PREFIX={prefix!r} must not contain '/'")
    return prefix


def copy_threads() -> int | None:
    """PYSHMCKPT_THREADS: threads for copies and prefaulting (default: min(cores, 8))."""
    raw = os.environ.get("PYSHMCKPT_THREADS")
    return _env_int("PYSHMCKPT_THREADS", 1, 1) if raw else None


def hold_timeout() -> float:
    """PYSHMCKPT_HOLD_TIMEOUT: seconds a writer holds the newest checkpoint in memory after its
    trainer died, waiting for a new trainer (default 600: a launcher's restart takes its stop
    grace period, a rendezvous and the new workers' start-up, well under ten minutes)."""
    return _env_float("PYSHMCKPT_HOLD_TIMEOUT", 600.0, 0.0)


def restore_timeout() -> float:
    """PYSHMCKPT_RESTORE_TIMEOUT: seconds ranks wait for each other to agree on the checkpoint
    they restore (default 300)."""
    return _env_float("PYSHMCKPT_RESTORE_TIMEOUT", 300.0, 1.0)


def orphan_wait() -> float:
    """PYSHMCKPT_ORPHAN_WAIT: seconds a restore of a root waits for a writer whose trainer died
    and that is still finishing the saves it was handed (the checkpoint it will hold may be the
    newest), before choosing without it (default 120; with several ranks at most half of
    ``PYSHMCKPT_RESTORE_TIMEOUT``)."""
    return _env_float("PYSHMCKPT_ORPHAN_WAIT", 120.0, 0.0)


def replica_timeout() -> float:
    """PYSHMCKPT_REPLICA_TIMEOUT: seconds one checkpoint's replication to its buddy node may take,
    its connection included (default 120: a buddy's writer that starts later is waited for)."""
    return _env_float("PYSHMCKPT_REPLICA_TIMEOUT", 120.0, 1.0)


def replica_address() -> str | None:
    """PYSHMCKPT_REPLICA_ADDRESS: the IPv4 address this node's writers listen on for replicas and
    that names this node (default: the local address of the route to MASTER_ADDR)."""
    return os.environ.get("PYSHMCKPT_REPLICA_ADDRESS") or None


def file_mode() -> int | None:
    """PYSHMCKPT_FILE_MODE: the permission bits, in octal (``640``, ``0640`` or ``0o640``), of
    every file pyshmckpt creates under a checkpoint root (checkpoint files, ``commit.json``,
    heartbeats, tombstones, markers, files of the torch writers), set exactly whatever the
    umask. Each directory it creates gets the same bits with search (x) added wherever read is
    allowed (``640``: files ``rw-r-----``, directories ``rwxr-x---``). Default (unset or empty,
    None here): what the process's umask gives, as ``torch.save`` and ``cp`` do (files ``0666``
    and directories ``0775`` less the umask). Directories are never made writable by others,
    whatever the setting or umask; the owner must be allowed to read and write."""
    raw = os.environ.get("PYSHMCKPT_FILE_MODE")
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip(), 8)
    except ValueError:
        raise ConfigError(f"PYSHMCKPT_FILE_MODE={raw!r} is not an octal mode such as 640") from None
    if not 0 <= value <= 0o777:
        raise ConfigError(f"PYSHMCKPT_FILE_MODE={raw!r} must hold permission bits only (0 to 777)")
    if value & 0o600 != 0o600:
        raise ConfigError(f"PYSHMCKPT_FILE_MODE={raw!r} must let the owner read and write (6xx)")
    return value


def replica_encrypt() -> bool:
    """PYSHMCKPT_REPLICA_ENCRYPT: 1 to encrypt everything sent between nodes (replicas, and
    copies fetched during a restore) with AES-256-GCM; it needs the ``encrypt`` extra (the
    cryptography package: ``python -m pip install ".[encrypt]"`` in a clone of the repository).
    Either end asking for it is enough. Default 0: every message and byte is authenticated (a
    MAC under a key of the connection), not encrypted."""
    raw = (os.environ.get("PYSHMCKPT_REPLICA_ENCRYPT") or "0").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"PYSHMCKPT_REPLICA_ENCRYPT={raw!r} must be 0 or 1")


def object_part_size() -> int:
    """PYSHMCKPT_OBJECT_PART_SIZE: bytes per part of an upload and per ranged read from object
    storage (default 32 MiB; S3 takes parts of at least 5 MiB but the last; larger where a file
    would need more than 10,000 parts on S3, 32,768 on Google Cloud Storage)."""
    return _env_int("PYSHMCKPT_OBJECT_PART_SIZE", 32 * _MIB, 64 << 10)


def object_concurrency() -> int:
    """PYSHMCKPT_OBJECT_CONCURRENCY: parts uploaded, or ranges read, at once per file (default 16)."""
    return _env_int("PYSHMCKPT_OBJECT_CONCURRENCY", 16, 1)


def object_attempts() -> int:
    """PYSHMCKPT_OBJECT_ATTEMPTS: tries of one request to object storage, the first included,
    when the service throttles or fails (5xx), with exponential backoff and jitter (default 8)."""
    return _env_int("PYSHMCKPT_OBJECT_ATTEMPTS", 8, 1)


def object_abandoned_after() -> float:
    """PYSHMCKPT_OBJECT_ABANDONED_AFTER: seconds after its start that an unfinished upload (an S3
    multipart upload, or the parts of one on Google Cloud Storage), or the objects of a
    checkpoint that was never committed, count as abandoned and are
    removed when a root is opened (default 86400: a day, far longer than any upload a live
    writer may still be finishing)."""
    return _env_float("PYSHMCKPT_OBJECT_ABANDONED_AFTER", 86400.0, 0.0)
