"""An attempt's gloo connections, and a way to break them at once when the attempt fails.

Standard library only: it works on the process's sockets through /proc."""

from __future__ import annotations

import os
import socket


class GroupTransport:
    """The TCP connections of this attempt's gloo process groups, and a way to break them at once.

    A gloo collective blocked on a peer returns only when its timeout expires or its connection
    breaks. In torch 2.13 (measured with two processes) none of ``ProcessGroup.abort()``,
    ``shutdown()``, the backend's ``abort()``/``shutdown()``, ``dist.destroy_process_group`` or
    ``distributed_c10d._abort_process_group`` interrupts a pending gloo receive, on the blocked rank
    or on its peer: the group's sockets close only when its last reference goes, and after a fault
    a traceback holding the model (its DTensors hold the mesh, the mesh the groups) keeps it.
    ``shutdown(2)`` on the group's connections does it: the pending operations fail within
    milliseconds with "Connection closed by peer", on this rank and on every peer connected to it.
    The descriptors stay open (gloo owns them and closes them when the group is freed), so this
    is safe from any thread, at any time, and more than once.

    Which sockets: the TCP connections this process opened or accepted between ``mark`` (just
    before the attempt's first gloo group forms) and ``seal`` (just after its last one formed),
    less those of the stores (``MASTER_PORT`` .. +2, and any server listening before ``mark``):
    the pairs of the attempt's gloo groups. On gloo those are every group the attempt made (the
    default group, a device mesh's, the save protocol's); on NCCL, the save protocol's gloo group
    alone (``mark`` comes after NCCL's groups formed, whose own sockets are NCCL's to abort).
    Before ``seal``, everything opened since ``mark``. Listening sockets are left alone: gloo's
    listener treats a failed accept as fatal.
    """

    def __init__(self) -> None:
        self._before: frozenset[str] | None = None  # "socket:[inode]" of sockets open before mark
        self._skip_ports: frozenset[int] = frozenset()
        self._sealed: frozenset[str] | None = None  # the attempt's connections, once sealed

    def mark(self) -> None:
        """Call just before the attempt's first gloo process group forms."""
        ports = set()
        if "MASTER_PORT" in os.environ:
            master = int(os.environ["MASTER_PORT"])
            ports |= {master, master + 1, master + 2}  # rendezvous, app_store, the Wrapper's store
        before = set()
        for link, sock in _borrowed_sockets():
            before.add(link)
            try:
                if _is_tcp(sock) and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    ports.add(sock.getsockname()[1])  # a server (a store) that predates the attempt
            except OSError:  # closed meanwhile
                pass
        self._before = frozenset(before)
        self._skip_ports = frozenset(ports)
        self._sealed = None

    def seal(self) -> int:
        """Call just after the attempt's last gloo group formed: from now on only the connections
        opened since ``mark`` are broken, whatever opens later. Returns how many there are."""
        if self._before is None:
            return 0
        self._sealed = frozenset(link for link, _ in self._connections())
        return len(self._sealed)

    def shut_down(self) -> int:
        """Break every connection of the attempt's groups; returns how many were shut down now.
        A no-op before ``mark``. Never raises: it runs on the way out of a fault."""
        if self._before is None:
            return 0
        count = 0
        for link, sock in self._connections():
            if self._sealed is not None and link not in self._sealed:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:  # not connected, already shut down, reset by the peer, or closed
                pass
        return count

    def _connections(self):
        """("socket:[inode]", socket) for each connected TCP socket opened since ``mark``, less
        the stores'."""
        for link, sock in _borrowed_sockets():
            if self._before is None or link in self._before:
                continue
            try:
                if not _is_tcp(sock) or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                if {sock.getsockname()[1], sock.getpeername()[1]} & self._skip_ports:
                    continue
            except OSError:  # not connected, or closed meanwhile
                continue
            yield link, sock


#: The current attempt's gloo connections: the Trainer marks and seals them around the attempt's
#: groups, a fault breaks them (``Trainer._on_fault`` on the failing rank, the Wrapper's abort on
#: every rank).
group_transport = GroupTransport()


def _borrowed_sockets():
    """("socket:[inode]", socket) for each open socket of this process (Linux /proc; none
    elsewhere). The socket objects wrap descriptors that others own: each is detached, never
    closed, before the next is made, and one whose descriptor was closed and reused meanwhile is
    left out."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        if not link.startswith("socket:["):
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == link:
                yield link, sock
        except OSError:
            pass
        finally:
            sock.detach()


def _is_tcp(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
