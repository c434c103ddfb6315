"""``grpc://HOST:PORT?token=T&codec=C&connect_timeout=S&timeout=S`` (and ``grpcs://...&tls_ca=PATH``): a
``RemoteStore`` to a ``kvshelf serve``, the opener ``kvstore.store_url`` names for these schemes."""

from __future__ import annotations

from typing import Any

from kvshelf.kvstore.codec import get_codec
from kvshelf.kvstore.tier_registry import TierURL
from kvshelf.service.client import RemoteStore

GRPC_PARAMS = ("token", "codec", "connect_timeout", "timeout", "tls_ca")


def open_url(url: TierURL, *, namespace: str, **options: Any) -> RemoteStore:
    """The ``RemoteStore`` ``url`` names; connects at once (``TierUnavailableError`` when no server answers within
    ``connect_timeout`` seconds, default 5)."""
    host, _, port = url.location.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in url.location:
        raise url.error("a gRPC store URL is grpc://HOST:PORT (a host and a port number)")
    token = url.take("token", options.pop("token", None)) or None
    codec = url.take("codec", options.pop("codec", "raw"))
    get_codec(codec)
    connect_timeout = url.take_float("connect_timeout", options.pop("connect_timeout_s", 5.0))
    timeout = url.take_float("timeout", options.pop("timeout_s", 60.0))
    tls_ca = url.take("tls_ca", options.pop("tls_ca", None))
    if url.scheme == "grpcs" and not tls_ca:
        raise url.error("grpcs:// needs tls_ca=PATH (the CA certificate that signed the server's)")
    if url.scheme == "grpc" and tls_ca:
        raise url.error("tls_ca is for grpcs:// URLs")
    url.done(GRPC_PARAMS)
    return RemoteStore(url.location, token=token, namespace=namespace, codec=codec, tls_ca=tls_ca,
                       connect_timeout_s=connect_timeout or 5.0, timeout_s=timeout or 60.0, **options)
