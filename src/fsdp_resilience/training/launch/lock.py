"""One launch per run per node: an exclusive ``flock`` on the node's lock file in the run dir,
held for the life of the launch (by the guard, until every process of the launch is gone).

The holder is recorded in the file: its pid and host, and on EKS its pod's UID and node name. A
pod the Job recreates for a lost index keeps the lost pod's host name (``<job>-<index>``), so on
EKS a predecessor is told by its pod UID, never by its host name; locally (no pod UID) by its
host, as launchers of one host are one machine's."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time

from fsdp_resilience.training.contract import NODE_ID_ENV, POD_UID_ENV, RunDir
from fsdp_resilience.training.launch.storage import StorageError

#: How often a launcher waiting for a dead predecessor's lock tries it again.
LOCK_POLL_S = 1.0


class AlreadyRunning(Exception):
    """Another fsdp_resilience.training.launch of this run and node holds the launch lock."""


#: How long a node's launcher waits for the launch lock held by a dead predecessor of the same
#: launch (another pod, or another host): a pod the Job recreated for a lost index, while the lost
#: machine's storage client still holds the lock (Lustre releases a dead client's locks when it
#: evicts it). Past it the lock is taken as stale and the launcher goes on without it.
PREDECESSOR_LOCK_WAIT_S = 300.0


def holder_identity() -> dict:
    """Who this launcher is, as the lock file records it."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "pod_uid": os.environ.get(POD_UID_ENV) or None,
        "node": os.environ.get(NODE_ID_ENV) or None,
    }


def is_predecessor(holder: dict, launch_id: str, me: dict) -> bool:
    """Whether the lock's ``holder`` is a dead predecessor of launcher ``me`` to wait for: the same
    launch, in another pod (both pod UIDs known: a recreated pod keeps the host name), else on
    another host. The same pod, or the same host without pod UIDs, is a second launcher: refused."""
    if not launch_id or holder.get("launch_id") != launch_id:
        return False
    if me.get("pod_uid") and holder.get("pod_uid"):
        return holder["pod_uid"] != me["pod_uid"]
    return holder.get("host") not in (None, me.get("host"))


def take_launch_lock(
    layout: RunDir, node_rank: int, launch_id: str = "", predecessor_wait_s: float = PREDECESSOR_LOCK_WAIT_S
) -> int | None:
    """Hold this node's launch lock (an exclusive ``flock``) for the life of the launch; returns
    its descriptor (close-on-exec: no rank or NVRx helper ever holds it), or None where the file
    system has no ``flock`` (a warning says a second launcher then goes undetected). Records who
    holds it in the file. Raises ``AlreadyRunning`` at once if another launcher holds it, unless
    the holder is a predecessor of this launch's node (``is_predecessor``: a lost node's launcher,
    whose lock outlives it until its storage client is evicted): that one is waited for, up to
    ``predecessor_wait_s``; then its lock is stale and this launcher goes on without it (None, with
    a warning). The Job controller recreates a pod only once the old one is terminal
    (podReplacementPolicy Failed), so a predecessor's holder is gone, whatever its lock says."""
    path = layout.launch_lock(node_rank)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StorageError(
            f"the run dir cannot take writes: cannot open the launch lock {path}: {e.strerror or e}"
        ) from None
    me = holder_identity()
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
            who = (
                f"fsdp_resilience.training.launch pid {holder.get('pid')} on {holder.get('host')}"
                + (f" (pod {holder['pod_uid']} on node {holder.get('node')})" if holder.get("pod_uid") else "")
                if holder.get("pid")
                else "another fsdp_resilience.training.launch (pid not recorded yet)"
            )
            if is_predecessor(holder, launch_id, me):
                if time.monotonic() < deadline:
                    time.sleep(LOCK_POLL_S)
                    continue
                print(
                    f"warning: {path} is still held by {who}, this launch's predecessor of node {node_rank}, "
                    f"after {predecessor_wait_s:.0f}s: taking its lock as stale (its pod is gone) and going on "
                    "without it",
                    file=sys.stderr,
                    flush=True,
                )
                os.close(fd)
                return None
            os.close(fd)
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
        os.pwrite(fd, json.dumps({**me, "since": time.time(), "launch_id": launch_id}).encode(), 0)
    except OSError:
        pass
    return fd
