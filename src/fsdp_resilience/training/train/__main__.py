"""``python -m fsdp_resilience.training.train``: one training worker (see the package)."""

import sys

from fsdp_resilience.training.train.cli import main

if __name__ == "__main__":  # the guard NVRx's async checkpoint workers need (they spawn)
    sys.exit(main())
