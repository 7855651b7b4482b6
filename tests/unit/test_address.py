"""kvstore_client.address: daemon addresses as users write them (no daemon)."""

from __future__ import annotations

import pytest

from kvstore_client import KVStoreClient
from kvstore_client.address import DEFAULT_PORT, with_default_port


@pytest.mark.parametrize(
    ("given", "address"),
    [
        ("localhost", f"localhost:{DEFAULT_PORT}"),
        ("10.0.0.5", f"10.0.0.5:{DEFAULT_PORT}"),
        (" kv.internal ", f"kv.internal:{DEFAULT_PORT}"),
        ("localhost:6000", "localhost:6000"),
        ("::1", f"[::1]:{DEFAULT_PORT}"),
        ("[::1]", f"[::1]:{DEFAULT_PORT}"),
        ("[fe80::1]:7000", "[fe80::1]:7000"),
        ("unix:/run/kvstore.sock", "unix:/run/kvstore.sock"),
        ("dns:///kv.internal:6000", "dns:///kv.internal:6000"),
    ],
)
def test_an_address_without_a_port_gets_the_daemons(given: str, address: str) -> None:
    assert DEFAULT_PORT == 50051
    assert with_default_port(given) == address


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("", "empty"),
        ("localhost:", "the port must be a number 1..65535"),
        ("localhost:http", "the port must be a number"),
        ("localhost:65536", "the port must be a number"),
        ("localhost:0", "the port must be a number"),
        ("[::1", r"\[IPV6\]:PORT"),
        ("[::1]x", "the port must be a number"),
        ("fe80::zz", "in brackets"),
    ],
)
def test_an_address_that_cannot_be_dialled_is_refused(given: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        with_default_port(given)
    assert given.strip() == "" or repr(given) in str(info.value)


def test_the_client_dials_the_daemons_port_for_a_bare_host() -> None:
    with KVStoreClient("localhost") as client:  # a channel connects lazily: nothing is dialled
        assert client.address == f"localhost:{DEFAULT_PORT}"
    with pytest.raises(ValueError, match="the port must be a number"):
        KVStoreClient("localhost:http")
