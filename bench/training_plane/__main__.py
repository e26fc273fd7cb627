"""``python -m bench.training_plane``: see the package docstring."""

import sys

from bench.training_plane.cli import main

if __name__ == "__main__":  # the guard the rank and writer processes it spawns need
    sys.exit(main())
