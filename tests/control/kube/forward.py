"""A byte pipe between a TCP port on 127.0.0.1 and a Unix socket, in either direction.

Karpenter binds its metrics and health servers on every interface and has no flag for the address,
so the harness runs it in a network namespace of its own (nothing outside can reach them); these
pipes carry its apiserver connection out of the namespace and its health endpoint in. A pipe ends
when its parent does (PR_SET_PDEATHSIG).

    python forward.py tcp-to-unix PORT SOCKET     listen on 127.0.0.1:PORT, connect to SOCKET
    python forward.py unix-to-tcp SOCKET PORT     listen on SOCKET, connect to 127.0.0.1:PORT
    python forward.py wait-tcp PORT               wait (up to 30 s) until 127.0.0.1:PORT accepts
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(listener: socket.socket, connect) -> None:
    while True:
        client, _ = listener.accept()
        try:
            upstream = connect()
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def main(argv: list[str]) -> None:
    if argv[0] == "wait-tcp":
        for _ in range(300):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", int(argv[1]))) == 0:
                    return
            time.sleep(0.1)
        raise SystemExit(f"nothing listens on 127.0.0.1:{argv[1]}")
    parent = os.getppid()
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the signal was armed
        raise SystemExit(0)
    mode, a, b = argv
    if mode == "tcp-to-unix":
        listener = socket.create_server(("127.0.0.1", int(a)))

        def connect():
            s = socket.socket(socket.AF_UNIX)
            s.connect(b)
            return s
    elif mode == "unix-to-tcp":
        if os.path.exists(a):
            os.unlink(a)
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(a)
        listener.listen(64)

        def connect():
            return socket.create_connection(("127.0.0.1", int(b)))
    else:
        raise SystemExit(__doc__)
    serve(listener, connect)


if __name__ == "__main__":
    main(sys.argv[1:])
