"""training.spawn hosts the rendezvous store in the launching process for the whole run: the
port is never freed and bound again later, where a test running alongside could take it first
(the EADDRINUSE that once failed CI)."""
import socket

import pytest

from megatron_2bw.training.spawn import connect_store, host_store


def test_the_hosted_store_holds_its_port_and_serves_a_client():
    store = host_store(2, timeout_minutes=0.2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))  # still held: nobody else can take it
    client = connect_store(store.port, 2, timeout_minutes=0.2)
    client.set("k", "v")
    assert store.get("k") == b"v"
