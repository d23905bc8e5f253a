"""``python -m pyshmckpt``: the command line (see pyshmckpt.cli)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    try:
        from pyshmckpt.cli import main
    except KeyboardInterrupt:  # Ctrl-C while torch is still being imported
        sys.exit(130)
    sys.exit(main())
