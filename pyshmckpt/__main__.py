import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while torch is still being imported
    sys.exit(130)

sys.exit(main())
