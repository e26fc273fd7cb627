"""A stand-in launcher: a ``LocalProcessBackend`` whose "training Python" is a shell script, for
tests of the backend's and the ladder's bookkeeping where real training would only cost time."""

from __future__ import annotations

from pathlib import Path


def script_backend(folder: Path, script: str, **kwargs):
    """A ``LocalProcessBackend`` whose "training Python" is the shell ``script`` (a stand-in
    launcher: it gets the same arguments ``fsdp_resilience.training.launch`` would), with its state in ``folder``."""
    from fsdp_resilience.control.backends import LocalProcessBackend

    folder.mkdir(parents=True, exist_ok=True)
    python = folder / "stand-in-python"
    python.write_text(script)
    python.chmod(0o755)
    return LocalProcessBackend(folder / "state", training_python=str(python), **kwargs)
