"""``python -m bench.gpu_check``: see the package docstring."""

import sys

from bench.gpu_check.cli import main

if __name__ == "__main__":  # the guard the checkpoint writer needs: it spawns this package's workers
    sys.exit(main())
