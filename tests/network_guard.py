"""The suite makes no off-machine attempt: an audit hook (``sys.addaudithook``) sees every
``socket.connect``, ``socket.sendto`` and ``socket.getaddrinfo`` of the test process, and records
those that leave this machine; ``tests/conftest.py`` fails the test that made one.

On this machine means an address of a local interface (loopback, and the machine's own addresses,
which a Ray joined by address listens on) or a name that needs no DNS (``localhost``, this host's
own name). Another name is a DNS lookup, an attempt in itself. Child processes (Ray's workers,
wandb's Go service) are outside the hook; ``tests/runtime/test_offline_trackers.py`` watches a
whole run with strace for them.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from typing import Any

#: Attempts off this machine seen since the hook was installed: ``event: address`` lines.
ATTEMPTS: list[str] = []
_installed = False


def _local_addresses() -> frozenset[str]:
    import psutil

    found = {"127.0.0.1", "::1", "0.0.0.0", "::"}
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                found.add(entry.address.split("%")[0])
    return frozenset(found)


def _is_local_ip(host: str, local: frozenset[str]) -> bool | None:
    """True or False for an IP address (loopback, or one of this machine's); None for a name."""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    address = mapped or address
    return address.is_loopback or address.is_unspecified or str(address) in local


def install() -> None:
    """Install the hook once per process (an audit hook cannot be removed)."""
    global _installed
    if _installed:
        return
    _installed = True
    local = _local_addresses()
    own_names = frozenset({"localhost", "ip6-localhost", socket.gethostname().lower(),
                           socket.getfqdn().lower()} - {""})

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in ("socket.connect", "socket.sendto"):
            sock, address = args[0], args[-1]
            if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6) or not isinstance(address, tuple):
                return
            host = str(address[0])
            verdict = _is_local_ip(host, local)
            if verdict is False or (verdict is None and host.lower() not in own_names):
                ATTEMPTS.append(f"{event}: {address[:2]}")
        elif event == "socket.getaddrinfo":
            host = args[0]
            if isinstance(host, bytes):
                host = host.decode(errors="replace")
            if not host or _is_local_ip(str(host), local) is not None:
                return
            if str(host).lower() not in own_names and not str(host).lower().endswith(".localhost"):
                ATTEMPTS.append(f"{event}: {host}")

    sys.addaudithook(hook)
