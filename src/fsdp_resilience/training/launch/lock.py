"""One launch per run per node: an exclusive ``flock`` on the node's lock file in the run dir,
held for the life of the launch (by the guard, until every process of the launch is gone)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time

from fsdp_resilience.training.contract import RunDir
from fsdp_resilience.training.launch.storage import StorageError

#: How often a launcher waiting for a dead predecessor's lock tries it again.
LOCK_POLL_S = 1.0


class AlreadyRunning(Exception):
    """Another fsdp_resilience.training.launch of this run and node holds the launch lock."""


#: How long a node's launcher waits for the launch lock held by a dead predecessor of the same
#: launch on another machine: a pod the Job recreated for a lost index, while the lost machine's
#: storage client still holds the lock (Lustre releases a dead client's locks when it evicts it).
PREDECESSOR_LOCK_WAIT_S = 300.0


def take_launch_lock(
    layout: RunDir, node_rank: int, launch_id: str = "", predecessor_wait_s: float = PREDECESSOR_LOCK_WAIT_S
) -> int | None:
    """Hold this node's launch lock (an exclusive ``flock``) for the life of the launch; returns
    its descriptor (close-on-exec: no rank or NVRx helper ever holds it), or None where the file
    system has no ``flock`` (a warning says a second launcher then goes undetected). Records who
    holds it in the file. Raises ``AlreadyRunning`` at once if another launcher holds it, unless
    the holder is this launch's node on another host (a lost node's launcher, whose lock outlives
    it until its storage client is evicted): that one is waited for, up to ``predecessor_wait_s``."""
    path = layout.launch_lock(node_rank)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StorageError(
            f"the run dir cannot take writes: cannot open the launch lock {path}: {e.strerror or e}"
        ) from None
    deadline = time.monotonic() + predecessor_wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except (OSError, ValueError):
                holder = {}
            predecessor = (
                bool(launch_id)
                and holder.get("launch_id") == launch_id
                and holder.get("host") not in (None, socket.gethostname())
            )
            if predecessor and time.monotonic() < deadline:
                time.sleep(LOCK_POLL_S)
                continue
            os.close(fd)
            who = (
                f"fsdp_resilience.training.launch pid {holder.get('pid')} on {holder.get('host')}"
                if holder.get("pid")
                else "another fsdp_resilience.training.launch (pid not recorded yet)"
            )
            raise AlreadyRunning(
                f"node {node_rank} of this run is already being launched: {path} is held by {who}. "
                "Not starting a second launcher; stop that one, or let it finish"
            ) from None
        except OSError as e:  # e.g. a Lustre client mounted with noflock
            print(
                f"warning: cannot lock {path} ({e.strerror or e}): a second launcher of this node would go undetected",
                file=sys.stderr,
                flush=True,
            )
            os.close(fd)
            return None
    try:  # who holds it, for the refusal message; best effort (a full disk may refuse even this)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "launch_id": launch_id}
            ).encode(),
            0,
        )
    except OSError:
        pass
    return fd
