"""Names of one run's entries on a shared root, which no one without the run's secret can predict.

Ranks that commit together share a run id, which is a secret: `Checkpointer` has rank 0 draw it
and broadcast it over torch.distributed (or takes the ``run_id`` every rank was given), the
DeepSpeed adapter draws its own the same way, and nothing writes it to disk. Every name the ranks
meet at on the root (each attempt's temporary directory and tombstone, each rank's heartbeat) is
an HMAC under it, and what the root shows of the run (the attempt a ``commit.json`` names,
DeepSpeed's markers) carries a public label instead, from which the secret cannot be recovered.
So another user who can list the root can neither predict such a name before it exists nor take
it first. A run id a caller passes is the secret itself: it must be as hard to guess as a drawn
one (``secrets.token_hex(16)`` shared with every rank), not a job number or a date.
"""

from __future__ import annotations

import hashlib
import hmac


def label(run: str) -> str:
    """A public name of the run (16 hex digits) that reveals nothing of its secret."""
    return _mac(run, "label")[:16]


def tag(run: str, *what: object) -> str:
    """The name part (32 hex digits) of the run's entry for `what` (a kind and its details):
    unpredictable without the run's secret, and unrelated to the tag of anything else."""
    return _mac(run, *what)[:32]


def _mac(run: str, *what: object) -> str:
    message = "\0".join(str(part) for part in what).encode()
    return hmac.new(run.encode(), message, hashlib.sha256).hexdigest()
