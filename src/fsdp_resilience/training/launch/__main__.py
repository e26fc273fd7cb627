"""``python -m fsdp_resilience.training.launch``: one node of a training run (see the package)."""

import sys

from fsdp_resilience.training.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
