"""ICE for the WebRTC transport: which local addresses are advertised, which STUN/TURN servers are used.

aiortc gathers host candidates through aioice, which asks the module-level function
``aioice.ice.get_host_addresses`` for every interface address (and always leaves 127.0.0.1 out). That
is wrong for an operator who must advertise one public or container address, and for loopback tests.
:func:`advertise_only` pins the list for the code running inside it (a context variable, so other peer
connections in the same process keep aioice's default), through a wrapper put around aioice's
function on first use. aiortc's own default ICE server (a public Google STUN server) is never used: an
empty server list means host candidates only, and no traffic to any other address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer

from realtime.config import IceServer

# None: aioice's default (every interface). A tuple: exactly these addresses.
_pinned_addresses: ContextVar[tuple[str, ...] | None] = ContextVar("rtc_pinned_addresses", default=None)
_aioice_host_addresses = aioice.ice.get_host_addresses


def _host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    """Drop-in for aioice's lookup: the pinned addresses when a pin is active, else aioice's own list."""
    pinned = _pinned_addresses.get()
    if pinned is None:
        return _aioice_host_addresses(use_ipv4, use_ipv6)
    versions = {4} if use_ipv4 else set()
    if use_ipv6:
        versions.add(6)
    return [address for address in pinned if ipaddress.ip_address(address).version in versions]


@contextmanager
def advertise_only(addresses: tuple[str, ...] | None) -> Iterator[None]:
    """Within this block, ICE gathering binds and advertises only ``addresses`` (None: every interface).

    Gathering happens inside ``RTCPeerConnection.setLocalDescription``; await it inside the block. Tasks
    it starts copy the current context, so the pin reaches them and nothing else.
    """
    # Installing the wrapper again is a no-op; it defers to aioice whenever no pin is active.
    aioice.ice.get_host_addresses = _host_addresses
    token = _pinned_addresses.set(addresses)
    try:
        yield
    finally:
        _pinned_addresses.reset(token)


def rtc_configuration(servers: Sequence[IceServer]) -> RTCConfiguration:
    """aiortc's configuration for ``servers``; always an explicit list, so aiortc never falls back to
    its built-in public STUN server."""
    return RTCConfiguration(
        iceServers=[
            RTCIceServer(urls=server.url, username=server.username, credential=server.credential)
            for server in servers
        ]
    )
