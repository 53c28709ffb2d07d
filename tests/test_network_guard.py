"""The suite's guard against off-machine attempts (``tests/network_guard.py``) sees them. The
events are raised with ``sys.audit`` as the socket module raises them, so that checking the guard
itself makes no attempt: a connect or send towards a public address and a lookup of another host
are recorded; loopback, this machine's own addresses, ``localhost`` and Unix sockets are not. Each
test takes back what it recorded, so the guard does not fail it."""

from __future__ import annotations

import socket
import sys

from tests import network_guard

PUBLIC = ("203.0.113.7", 53)  # TEST-NET-3: an address off any machine here


def _recorded(*events: tuple) -> list[str]:
    network_guard.install()
    before = len(network_guard.ATTEMPTS)
    for event in events:
        sys.audit(*event)
    made = network_guard.ATTEMPTS[before:]
    del network_guard.ATTEMPTS[before:]
    return made


def test_a_connect_or_send_off_the_machine_is_recorded():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        made = _recorded(("socket.connect", sock, PUBLIC), ("socket.sendto", sock, PUBLIC))
    assert made == [f"socket.connect: {PUBLIC}", f"socket.sendto: {PUBLIC}"]


def test_a_lookup_of_another_host_is_recorded():
    made = _recorded(("socket.getaddrinfo", "relax-guard-check.invalid", 80, 0, 0, 0))
    assert made == ["socket.getaddrinfo: relax-guard-check.invalid"]


def test_loopback_own_addresses_localhost_and_unix_sockets_are_not():
    own = sorted(network_guard._local_addresses())[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        made = _recorded(("socket.connect", sock, ("127.0.0.1", 9)), ("socket.connect", sock, ("localhost", 9)),
                         ("socket.connect", sock, (own, 9)), ("socket.getaddrinfo", "localhost", 80, 0, 0, 0),
                         ("socket.getaddrinfo", "127.0.0.1", 80, 0, 0, 0), ("socket.connect", unix, "/tmp/x"))
    assert made == []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # and a real loopback connect
        before = len(network_guard.ATTEMPTS)
        sock.connect(("127.0.0.1", 9))
        assert network_guard.ATTEMPTS[before:] == []
