"""The node's worker zygote: torch, NVRx and the trainer imported once, each rank forked from it.

An in-job restart used to start every rank as a fresh interpreter, which imports torch, NVRx and
this package again: most of the seconds such a restart took. ``fsdp_resilience.training.launch``
starts one zygote per node (``start_zygote``) before ft_launcher; it imports all of that once and
then listens on a Unix socket. ft_launcher's worker command is ``worker_client.py``, which asks the
zygote for a rank; the zygote forks, and the child becomes the rank with the client's stdin,
stdout, stderr, arguments, environment and working directory, then runs the trainer's
``__main__`` as ``python -m fsdp_resilience.training.train`` would. The zygote tells the client
the rank's pid and, when it ends, its exit status, which the client mirrors to the launcher.

Safe to fork because the zygote never touches CUDA, never starts a process group or a thread,
and serves every client from one thread (``select``); the same conditions the checkpointer's
forked writer relies on (``writer.fork_is_safe``). A client whose connection closes (killed by
the launcher) gets its rank killed. The zygote dies with the launch (parent-death signal), and the
launch ends whatever is left of its tree when it finishes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

from fsdp_resilience.training.launch.guard import parent_death_signal
from fsdp_resilience.training.launch.worker_client import STARTING_SUFFIX, TRAINER_MODULE, ZYGOTE_ENV

#: What the zygote imports before it listens: everything a rank imports before its first step
#: (measured: the modules a forked rank still imported), or it pays for them at every restart;
#: ``torch._dynamo`` alone, which building the model on meta pulls in, took 1.6 s of a restart.
#: The first entries are required; the rest are imported where they exist.
PRELOAD = ("torch", "torch.distributed", "nvidia_resiliency_ext.inprocess", "fsdp_resilience.training.train.cli")
PRELOAD_IF_PRESENT = (
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "torch.utils._sympy.reference",
    "nvidia_resiliency_ext.fault_tolerance",
    "numpy.random",
    "multiprocessing.queues",
    "multiprocessing.popen_fork",
    "multiprocessing.popen_spawn_posix",
)
CLIENT_SCRIPT = Path(__file__).with_name("worker_client.py")


def worker_command(args: list[str]) -> list[str]:
    """The worker part of the launcher's command: the client script (run as a file: starting it
    imports nothing) and the trainer's arguments."""
    return [str(CLIENT_SCRIPT), *args]


def new_socket_path() -> str:
    """A fresh socket path for a zygote, marked as starting (clients wait for it meanwhile)."""
    folder = tempfile.mkdtemp(prefix="fsdp-zygote-")  # short: a socket path has ~100 bytes
    path = os.path.join(folder, "sock")
    Path(path + STARTING_SUFFIX).touch()
    return path


def start_zygote(path: str, env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start a zygote listening on ``path`` (``new_socket_path``), as a child of this process that
    dies with it. Returns at once: clients wait while it imports. The launch's guard starts it,
    so the ranks and everything they start stay in the tree the guard ends."""
    return subprocess.Popen(
        [sys.executable, "-m", "fsdp_resilience.training.launch.worker_zygote", "--socket", path, *extra_args],
        env=env,
        start_new_session=True,
        preexec_fn=parent_death_signal(signal.SIGKILL),
    )


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: its length, JSON, and the client's stdin, stdout and stderr."""
    head, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
    if len(head) < 4:
        raise ConnectionError("the client closed before its request")
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the client closed mid-request")
        body += chunk
    return json.loads(body), fds


def _become_rank(request: dict, fds: list[int], module: str, die_with_zygote: Callable[[], None]) -> None:
    """In the forked child: take the client's place and run the trainer; never returns."""
    code = 1
    try:
        die_with_zygote()  # a rank never outlives the zygote (which dies with the launch)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdio
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            import torch

            torch.set_num_threads(int(threads))
        sys.argv = ["-m", *request["args"]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as a crashed rank would be
        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # as interpreter exit would (the checkpointer stops its writer)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _peek(conn: socket.socket) -> bytes:
    """What a client sent after its request (nothing ever); b"" once it is gone."""
    try:
        return conn.recv(1, socket.MSG_PEEK)
    except OSError:
        return b""


def serve(path: str, module: str = TRAINER_MODULE) -> None:
    """Listen on ``path`` and fork a rank (``python -m module`` with the client's arguments) for
    each client until killed; one thread."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    Path(path + STARTING_SUFFIX).unlink(missing_ok=True)
    ranks: dict[int, socket.socket] = {}  # rank pid -> its client's connection
    die_with_zygote = parent_death_signal(signal.SIGKILL)
    while True:
        conns = list(ranks.values())
        readable, _, _ = select.select([listener, *conns], [], [], 0.05)
        for ready in readable:
            if ready is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError) as e:
                    print(f"[zygote] bad request: {e}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in ranks.values():
                        other.close()
                    conn.close()
                    _become_rank(request, fds, module, die_with_zygote)
                for fd in fds:
                    os.close(fd)
                ranks[pid] = conn
                conn.sendall(f"pid {pid}\n".encode())
            elif not _peek(ready):  # its client is gone (killed): so is its rank
                pid = next(p for p, c in ranks.items() if c is ready)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while ranks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = ranks.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the Unix socket path to listen on")
    parser.add_argument("--module", default=TRAINER_MODULE, help=argparse.SUPPRESS)  # tests: a stand-in rank
    parser.add_argument("--no-preload", action="store_true", help=argparse.SUPPRESS)  # tests: no torch
    args = parser.parse_args(argv)
    import importlib

    try:
        for module in () if args.no_preload else PRELOAD:
            importlib.import_module(module)
        for module in () if args.no_preload else PRELOAD_IF_PRESENT:
            try:
                importlib.import_module(module)
            except ImportError:
                pass
    except BaseException as e:  # noqa: BLE001 - clients start ranks without it
        Path(args.socket + STARTING_SUFFIX).unlink(missing_ok=True)
        print(f"[zygote] not started: importing failed ({e}); ranks start on their own", file=sys.stderr)
        return 1
    os.environ.pop(ZYGOTE_ENV, None)
    # What is imported now lives for every rank: out of the collector's reach, so a collection in a
    # rank does not touch (and copy, page by page) the whole shared heap.
    gc.collect()
    gc.freeze()
    # Python 3.12+ warns at each fork of a process with more than one OS thread; importing torch
    # leaves one idle native thread of its own, which the ranks never need (the checkpointer's
    # forked writer lives with it the same way).
    warnings.filterwarnings("ignore", message=r".*multi-threaded.*fork", category=DeprecationWarning)
    serve(args.socket, args.module)
    return 0


if __name__ == "__main__":
    sys.exit(main())
