"""The training worker command under ft_launcher: one rank, forked from the node's zygote.

ft_launcher (or torchrun) starts ``python -u worker_client.py --config RUN.json`` for each rank at
every in-job restart. A fresh interpreter importing torch and NVRx again would take seconds each
time, so this script (standard library only, run as a file, never as part of the package, so
starting it imports nothing) asks the node's zygote (``worker_zygote``, started once per launch with
torch and NVRx already imported) to fork the rank instead, hands it this process's stdin, stdout
and stderr, arguments, environment and working directory, and then stands in for it:

- the launcher's signals (SIGTERM, SIGINT, ...) are passed on to the rank (with SIGCONT, so a frozen
  rank gets them too);
- this process exits as the rank did: the same exit code, or killed by the same signal, so the
  launcher classifies the failure as it would have;
- if this process is killed (SIGKILL, which cannot be passed on), the zygote sees its connection
  close and kills the rank.

Where no zygote is announced (``FSDP_WORKER_ZYGOTE`` unset, or ``off``: the launch then starts
none), it cannot be reached, or it is still starting
after ``FSDP_WORKER_ZYGOTE_WAIT_S``, this process becomes the rank itself: it execs ``python -u -m
fsdp_resilience.training.train`` with the same arguments, as before there was a zygote.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time

ZYGOTE_ENV = "FSDP_WORKER_ZYGOTE"  # the zygote's socket path
ZYGOTE_OFF = "off"  # FSDP_WORKER_ZYGOTE=off in the launch's environment: no zygote, ranks start on their own
ZYGOTE_WAIT_ENV = "FSDP_WORKER_ZYGOTE_WAIT_S"
STARTING_SUFFIX = ".starting"  # exists while the zygote imports, before it listens
DEFAULT_WAIT_S = 60.0
TRAINER_MODULE = "fsdp_resilience.training.train"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def exec_trainer(args: list[str], why: str) -> None:
    """Become the rank: the trainer in this process, started as before there was a zygote."""
    if why:
        print(f"[worker] starting without the zygote: {why}", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-u", "-m", TRAINER_MODULE, *args])


def connect(path: str, wait_s: float) -> socket.socket | None:
    """A connection to the zygote; waits while it is still starting (at most ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except OSError:
            conn.close()
            if not os.path.exists(path + STARTING_SUFFIX) or time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def send_request(conn: socket.socket, args: list[str]) -> None:
    """One request: its length, then JSON (arguments, environment, working directory); stdin,
    stdout and stderr travel with it as file descriptors."""
    body = json.dumps({"args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], [0, 1, 2])


def exit_as(status: int) -> None:
    """Exit as the rank did: ``status`` >= 0 an exit code, < 0 killed by signal -status."""
    sys.stdout.flush()
    sys.stderr.flush()
    if status < 0:
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        time.sleep(5)  # a signal that does not end a process by default (SIGCHLD, ...)
        os._exit(128 + -status)
    os._exit(status)


def main() -> None:
    args = sys.argv[1:]
    path = os.environ.get(ZYGOTE_ENV, "")
    if path in ("", ZYGOTE_OFF):
        exec_trainer(args, "")
    conn = connect(path, float(os.environ.get(ZYGOTE_WAIT_ENV, DEFAULT_WAIT_S)))
    if conn is None:
        exec_trainer(args, f"no zygote at {path}")
    child = 0
    try:
        send_request(conn, args)
        reader = conn.makefile("r")
        reply = reader.readline().split()
    except OSError as e:
        exec_trainer(args, f"the zygote did not answer ({e})")
    if reply[:1] != ["pid"]:
        exec_trainer(args, f"the zygote refused: {' '.join(reply)}")
    child = int(reply[1])

    def forward(signum: int, _frame: object) -> None:
        for sig in (signum, signal.SIGCONT):
            try:
                os.kill(child, sig)
            except ProcessLookupError:
                pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            line = reader.readline().split()
            break
        except InterruptedError:
            continue
    if line[:1] != ["exit"]:  # the zygote is gone: the rank with it, or it is ended here
        forward(signal.SIGKILL, None)
        print("[worker] lost the zygote; the rank was killed", file=sys.stderr, flush=True)
        exit_as(1)
    exit_as(int(line[1]))


if __name__ == "__main__":
    main()
