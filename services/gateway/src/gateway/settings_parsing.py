"""How a setting's text becomes its value: a list or a map given as JSON or as pairs, an
`api_keys` entry's alias, a host that binds loopback only, a backend URL's base, the
`backends_dns` target and its nameserver.

Owns: those pure readers, each raising ValueError that says the form expected (settings.py
turns it into the setting's error). Does not own: the settings object (settings.py), the
inference serve config the gateway reads (serve_config.py).
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any


def split_list(v: Any) -> Any:
    """A list given as JSON or as a comma-separated string."""
    if isinstance(v, str):
        s = v.strip()
        if s.startswith("["):
            return json.loads(s)
        return [p.strip() for p in s.split(",") if p.strip()]
    return v


_ALIAS = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")


def split_alias(entry: str) -> tuple[str, str]:
    """An api_keys entry `ALIAS=KEY` as (alias, key); `KEY` alone as ('', key). The alias
    is what /metrics and errors show (never the key); a key holding '=' needs an alias."""
    alias, sep, key = entry.partition("=")
    if sep and key and _ALIAS.fullmatch(alias):
        return alias, key
    return "", entry


def is_loopback(host: str) -> bool:
    """True when `host` (an address or name uvicorn binds) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def split_map(v: Any, form: str, *, last: bool = False) -> Any:
    """A map given as JSON or as key=value,key=value (split at the first "=", or the last)."""
    if not isinstance(v, str):
        return v
    s = v.strip()
    if s.startswith("{"):
        return json.loads(s)
    pairs = [p.rsplit("=", 1) if last else p.split("=", 1) for p in s.split(",") if p.strip()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(form)
    return {k.strip(): val.strip() for k, val in pairs}


def dns_target(value: str) -> tuple[str, int]:
    """(name, port) of a `backends_dns` value NAME:PORT; ValueError saying the form."""
    name, sep, port = value.strip().rpartition(":")
    if not sep or not name or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"backends_dns {value!r} must be NAME:PORT, e.g."
            " inference.lorastack.svc.cluster.local:8000"
        )
    return name.rstrip("."), int(port)


def nameserver(value: str) -> tuple[str, int]:
    """(IP, port) of a `backends_dns_nameserver` value IP[:PORT] (port 53 by default)."""
    host, _, port = value.strip().rpartition(":")
    if _is_ip(value.strip().strip("[]")):  # no port (an IPv6 address holds ':' itself)
        host, port = value.strip(), "53"
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ValueError(
            f"backends_dns_nameserver {value!r} must be IP[:PORT], e.g. 10.96.0.10:53"
        ) from None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"backends_dns_nameserver {value!r}: the port must be 1..65535")
    return host.strip("[]"), int(port)


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def base_url(url: str) -> str:
    """A vLLM URL without its trailing slash or /v1."""
    return url.rstrip("/").removesuffix("/v1")
