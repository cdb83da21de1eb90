"""ICE policy for WebRTC: which local addresses are advertised, which STUN/TURN servers are used.

aiortc gathers host candidates through aioice, which asks the module-level function
``aioice.ice.get_host_addresses`` for every interface address (and always leaves 127.0.0.1 out). That
is wrong for an operator who must advertise one public or container address, and for loopback tests.
:func:`advertise_only` pins the list for the code running inside it (a context variable, so other peer
connections in the same process keep aioice's default), through a wrapper installed once around
aioice's function. aiortc's own default ICE server (a public Google STUN server) is never used: an
empty server list means host candidates only, and no traffic to any other address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer

_URL_SCHEMES = ("stun:", "stuns:", "turn:", "turns:")

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
    # Installed lazily and once; the wrapper defers to aioice whenever no pin is active.
    aioice.ice.get_host_addresses = _host_addresses
    token = _pinned_addresses.set(addresses)
    try:
        yield
    finally:
        _pinned_addresses.reset(token)


@dataclass(frozen=True)
class IceServer:
    """One STUN or TURN server, as a browser's RTCIceServer: ``turn:host:port?transport=udp`` etc."""

    url: str
    username: str | None = None
    credential: str | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(_URL_SCHEMES):
            raise ValueError(f"ICE server url must start with one of {_URL_SCHEMES}, got {self.url!r}")
        if self.url.startswith("turn") and (self.username is None or self.credential is None):
            raise ValueError(f"TURN server {self.url!r} needs a username and a credential")


@dataclass(frozen=True)
class IcePolicy:
    """Where the server's media may flow.

    ``host_addresses``: local addresses to bind and advertise as host candidates (None: every
    interface, aioice's default). ``servers``: STUN/TURN servers; aiortc uses at most one of each kind.
    """

    host_addresses: tuple[str, ...] | None = None
    servers: tuple[IceServer, ...] = ()

    def __post_init__(self) -> None:
        for address in self.host_addresses or ():
            try:
                ipaddress.ip_address(address)
            except ValueError:
                raise ValueError(f"ICE host address must be an IP address, got {address!r}") from None
        if self.host_addresses == ():
            raise ValueError("ICE host_addresses is empty: give at least one address, or None for all")

    def rtc_configuration(self) -> RTCConfiguration:
        """The aiortc configuration; an explicit list, so aiortc never falls back to its public STUN."""
        return RTCConfiguration(
            iceServers=[
                RTCIceServer(urls=server.url, username=server.username, credential=server.credential)
                for server in self.servers
            ]
        )
