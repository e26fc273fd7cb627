"""Breaking an attempt's connections (fsdp_resilience.training.restart.gloo_transport), on plain
TCP sockets standing in for a gloo group's pairs."""

from __future__ import annotations

import socket

from fsdp_resilience.training.restart.gloo_transport import GroupTransport


def connected_pair(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return client, accepted


def test_only_the_connections_opened_since_mark_are_broken(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    transport = GroupTransport()
    assert transport.shut_down() == 0  # before mark: a no-op
    store = socket.create_server(("127.0.0.1", 0))
    store_client, store_accepted = connected_pair(store)  # a store's connection: it predates the attempt
    transport.mark()
    group = socket.create_server(("127.0.0.1", 0))  # the attempt's group listens after mark
    client, accepted = connected_pair(group)
    late_store_client, late_store_accepted = connected_pair(store)  # to a server listening before mark
    try:
        # Both ends of the group's connection; listeners and the stores' connections are left alone.
        assert transport.shut_down() == 2
        assert client.recv(1) == b"" and accepted.recv(1) == b""
        for a, b in ((store_client, store_accepted), (late_store_client, late_store_accepted)):
            a.sendall(b"x")
            assert b.recv(1) == b"x"
        transport.shut_down()  # safe more than once
    finally:
        for s in (store_client, store_accepted, client, accepted, late_store_client, late_store_accepted, group, store):
            s.close()


def test_once_sealed_only_the_attempts_groups_are_broken(monkeypatch):
    """On CUDA the attempt's only gloo group is the save protocol's: marked just before it forms,
    sealed just after. What opens later (NCCL's own sockets, say) is not the transport's to break."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    transport = GroupTransport()
    assert transport.seal() == 0  # before mark: nothing
    transport.mark()
    group = socket.create_server(("127.0.0.1", 0))
    client, accepted = connected_pair(group)  # the protocol group's pair
    assert transport.seal() == 2
    later_client, later_accepted = connected_pair(group)  # opened after the seal
    try:
        assert transport.shut_down() == 2
        assert client.recv(1) == b"" and accepted.recv(1) == b""
        later_client.sendall(b"x")
        assert later_accepted.recv(1) == b"x"
        transport.mark()  # the next attempt starts afresh: unsealed until it seals again
        fresh_group = socket.create_server(("127.0.0.1", 0))
        fresh_client, fresh_accepted = connected_pair(fresh_group)
        try:
            assert transport.shut_down() == 2
            assert fresh_client.recv(1) == b""
        finally:
            for s in (fresh_client, fresh_accepted, fresh_group):
                s.close()
    finally:
        for s in (client, accepted, later_client, later_accepted, group):
            s.close()
