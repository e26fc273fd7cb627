"""Process lifetime: nothing of a launch outlives it (Linux prctl).

The guard (``supervise``) sits between ``fsdp_resilience.training.launch`` and ft_launcher: a
subreaper that outlives every process of the launch and ends them all when ft_launcher exits, or at
once when the launcher dies (its parent-death signal)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Callable

from fsdp_resilience.training.faults import descendants

#: How long the guard gets to end its process tree after being told to (and what is left of a
#: tree gets to die) before the next, harder step.
KILL_GRACE_S = 10.0

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: The guard's parent-death signal, and fsdp_resilience.training.launch's "end everything now" to the guard.
END_NOW_SIGNAL = signal.SIGUSR1


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _prctl(option: int, value: int) -> None:
    if _libc().prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}): {os.strerror(err)}")


def become_subreaper() -> None:
    """Orphans below this process (a rank whose ft_launcher died, a daemon that double-forked into
    a session of its own) are reparented to it, not to init, so it can find and end them."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def parent_death_signal(sig: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when this process dies (even by SIGKILL). If this
    process is already gone by the time the child sets it, the child exits at once."""
    parent = os.getpid()
    _libc()  # loaded here, not in the forked child

    def preexec() -> None:
        _prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:
            os._exit(128 + int(sig))

    return preexec


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def _reap_exited() -> None:
    """Collect every exited child (adopted orphans included), so none stays a zombie. Only call
    it where no child's exit status still matters to anyone (``subprocess`` would lose it)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_process_tree(timeout_s: float = KILL_GRACE_S) -> list[int]:
    """SIGKILL every process below this one until none is left (ranks and NVRx daemons may have
    started sessions of their own: found by parentage, not by process group), reaping them.
    Returns those still there after ``timeout_s`` (stuck in the kernel, e.g. on a hung mount)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = descendants(os.getpid())
        for pid in left:
            if not _is_zombie(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _reap_exited()
        if not left:
            return []
        if time.monotonic() > deadline:
            return [p for p in left if not _is_zombie(p)]
        time.sleep(0.05)


def supervise(lock_fd: int, command: list[str]) -> int:
    """The guard: fsdp_resilience.training.launch's child, the parent of ft_launcher (or torchrun).

    It is a subreaper, so every process of the launch stays below it whatever sessions they
    start. It ignores the SIGTERM that fsdp_resilience.training.launch sends to the process group to stop
    ft_launcher gracefully, and outlives ft_launcher: then it ends what is left and exits with
    ft_launcher's status. On ``END_NOW_SIGNAL`` (its parent-death signal: fsdp_resilience.training.launch died;
    or fsdp_resilience.training.launch's hard stop) it kills the whole tree at once. It holds the launch lock
    (inherited from fsdp_resilience.training.launch), so the lock is free only when the launch's processes are
    gone; ft_launcher does not inherit it."""
    if lock_fd >= 0:
        os.set_inheritable(lock_fd, False)
    become_subreaper()

    def end_now(signum, _frame) -> None:
        end_process_tree()
        os._exit(128 + signum)

    signal.signal(END_NOW_SIGNAL, end_now)
    for sig in (signal.SIGTERM, signal.SIGINT):
        # A handler, not SIG_IGN: an ignored signal would stay ignored in ft_launcher after exec.
        signal.signal(sig, lambda *_: None)
    from fsdp_resilience.training.launch.worker_client import STARTING_SUFFIX, ZYGOTE_ENV
    from fsdp_resilience.training.launch.worker_zygote import start_zygote  # it imports this module

    zygote_socket = os.environ.get(ZYGOTE_ENV, "")
    if zygote_socket and os.path.exists(zygote_socket + STARTING_SUFFIX):
        # The node's worker zygote (fsdp_resilience.training.launch made its socket path): here,
        # below this subreaper, so the ranks it forks and all they start are in the tree it ends.
        start_zygote(zygote_socket)
    try:
        child = subprocess.Popen(command, preexec_fn=parent_death_signal(signal.SIGKILL))
    except OSError as e:
        print(f"error: cannot start {command[0]}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 127
    while True:  # wait for ft_launcher, reaping adopted orphans meanwhile
        pid, status = os.waitpid(-1, 0)
        if pid == child.pid:
            break
    child.returncode = os.waitstatus_to_exitcode(status)  # so Popen.__del__ does not wait on it
    left = end_process_tree()
    if left:
        print(f"[launch] processes that would not die: {left}", file=sys.stderr, flush=True)
    if child.returncode < 0:  # pass a death by signal on as one
        sig = -child.returncode
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig  # a signal whose default is to be ignored
    return child.returncode


def guard_command(lock_fd: int, command: list[str]) -> list[str]:
    return [
        sys.executable,
        "-c",
        "import sys; from fsdp_resilience.training.launch.guard import supervise; "
        "sys.exit(supervise(int(sys.argv[1]), sys.argv[2:]))",
        str(lock_fd),
        *command,
    ]
