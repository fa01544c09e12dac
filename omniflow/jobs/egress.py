"""Where webhooks may go: the SSRF policy for outbound HTTP.

A webhook URL must be http(s) and every address its host resolves to must be
public: loopback, private (RFC 1918, ULA), link-local (cloud metadata lives at
169.254.169.254), CGNAT, multicast, reserved and unspecified addresses are
refused, unless `webhook_allow_private` is set or the host (by name, address
or CIDR) is in `webhook_allow_hosts`. The checked address is the one the
request then connects to (no second lookup), so DNS rebinding cannot swap it.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from omniflow.config import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

ALLOWED_SCHEMES = frozenset({"http", "https"})
_CGNAT = ipaddress.ip_network("100.64.0.0/10")


class EgressRefused(Exception):
    """The URL may not be called; the message says why (it is recorded and logged)."""


@dataclass(frozen=True, slots=True)
class EgressPolicy:
    allow_private: bool = False
    allow_names: frozenset[str] = frozenset()
    allow_networks: tuple[Network, ...] = ()

    @classmethod
    def from_settings(cls, settings: Settings) -> EgressPolicy:
        names, networks = set(), []
        for item in (x.strip().lower() for x in settings.webhook_allow_hosts.split(",")):
            if not item:
                continue
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                names.add(item.rstrip("."))
        return cls(allow_private=settings.webhook_allow_private, allow_names=frozenset(names),
                   allow_networks=tuple(networks))

    def host_allowed(self, host: str) -> bool:
        return self.allow_private or host.lower().rstrip(".") in self.allow_names

    def address_allowed(self, addr: IPAddress) -> bool:
        return self.allow_private or any(addr in net for net in self.allow_networks)


def forbidden_reason(addr: IPAddress) -> str | None:
    """Why `addr` is not a public address, or None when it is."""
    checks = (("loopback", addr.is_loopback), ("link-local", addr.is_link_local),
              ("unspecified", addr.is_unspecified), ("multicast", addr.is_multicast),
              ("shared (CGNAT)", isinstance(addr, ipaddress.IPv4Address) and addr in _CGNAT),
              ("private", addr.is_private), ("reserved", addr.is_reserved))
    return next((name for name, hit in checks if hit), None)


def split_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an absolute http(s) URL; EgressRefused otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise EgressRefused(f"invalid URL {url!r}: {exc}") from exc
    if parts.scheme not in ALLOWED_SCHEMES:
        raise EgressRefused(f"scheme {parts.scheme or '(none)'!r} is not allowed; use http or https")
    if not parts.hostname:
        raise EgressRefused(f"URL {url!r} has no host")
    if parts.username or parts.password:
        raise EgressRefused("URLs with credentials are not allowed")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _literal(host: str) -> IPAddress | None:
    """The address `host` spells, in any form a resolver reads without DNS (127.0.0.1, ::1, 127.1, 0x7f000001)."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def check_url_static(url: str, policy: EgressPolicy) -> None:
    """What can be known about `url` without a DNS lookup (at submit time): scheme, host, no
    credentials, and, for an address literal or `localhost`, that it is public or allowed."""
    _scheme, host, _port = split_url(url)
    if policy.host_allowed(host):
        return
    addr = _literal(host)
    if addr is None:
        if host.lower().rstrip(".") in ("localhost", "localhost.localdomain"):
            raise EgressRefused(f"{host} is a loopback address; webhooks go to public addresses only "
                                "(allow it with OMNIFLOW_WEBHOOK_ALLOW_HOSTS or OMNIFLOW_WEBHOOK_ALLOW_PRIVATE)")
        return      # a name: resolved, and checked, when the webhook is sent
    plain = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped else addr
    reason = forbidden_reason(plain)
    if reason and not policy.address_allowed(plain):
        raise EgressRefused(f"{host} is a {reason} address; webhooks go to public addresses only "
                            "(allow it with OMNIFLOW_WEBHOOK_ALLOW_HOSTS or OMNIFLOW_WEBHOOK_ALLOW_PRIVATE)")


async def resolve(host: str, port: int) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise EgressRefused(f"cannot resolve {host!r}: {exc}") from exc
    seen: dict[IPAddress, None] = {}
    for info in infos:
        seen.setdefault(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]), None)
    if not seen:
        raise EgressRefused(f"{host!r} resolves to no address")
    return list(seen)


async def check_url(url: str, policy: EgressPolicy) -> IPAddress:
    """The address to connect to for `url`, after checking the host and every address it resolves to."""
    _scheme, host, port = split_url(url)
    addrs = await resolve(host, port)
    if policy.host_allowed(host):
        return addrs[0]
    for addr in addrs:
        plain = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped else addr
        reason = forbidden_reason(plain)
        if reason and not policy.address_allowed(plain):
            where = f"{host} is" if host == str(addr) else f"{host} resolves to {addr},"
            raise EgressRefused(
                f"{where} a {reason} address; webhooks go to public addresses only "
                "(allow it with OMNIFLOW_WEBHOOK_ALLOW_HOSTS or OMNIFLOW_WEBHOOK_ALLOW_PRIVATE)"
            )
    return addrs[0]
