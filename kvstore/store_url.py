"""Whole stores by URL: one string names a ``BlockStore`` for a consumer configured by text (the vLLM connector's
``kv_connector_extra_config``)::

    open_store("embedded:///var/lib/kvshelf?memory=1GiB&disk_codec=int8")  # memory over LMDB in that directory
    open_store("embedded://")                                               # the same in the default data dir
    open_store("grpc://127.0.0.1:50051?token=SECRET")                       # RemoteStore to a ``kvshelf serve``
    open_store("redis://cache:6379/0?codec=zstd")                           # a TieredStore over one Redis tier

Schemes resolve lazily as ``"module:function"`` strings (as ``kvstore.tier_registry`` does for tiers), so kvstore
names the gRPC client without importing the service part: ``grpc://`` opens through ``service.client_url.open_url``.
Each opener reads its query parameters with the ``TierURL`` helpers and calls ``url.done()``; a bad URL, an
unknown parameter or codec is a ``ConfigError`` naming the URL; a server that cannot be reached is a
``TierUnavailableError``. ``namespace`` is the store's namespace (reads and writes default to it).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.protocol import DEFAULT_NAMESPACE, BlockStore
from kvshelf.kvstore.tier_registry import TierURL

#: scheme -> "module:function" opening a store of it (imported on first use)
STORE_SCHEMES: dict[str, str] = {
    "embedded": "kvshelf.kvstore.store_url:open_embedded_url",
    "grpc": "kvshelf.service.client_url:open_url",
    "grpcs": "kvshelf.service.client_url:open_url",
    "redis": "kvshelf.kvstore.store_url:open_redis_url",
    "rediss": "kvshelf.kvstore.store_url:open_redis_url",
    "redis+cluster": "kvshelf.kvstore.store_url:open_redis_url",
    "rediss+cluster": "kvshelf.kvstore.store_url:open_redis_url",
}


def parse_store_url(url: str) -> TierURL:
    """``url`` split into scheme, location and query (``ConfigError`` for a non-URL or an unknown scheme)."""
    return TierURL.parse(url, STORE_SCHEMES, kind="store")


def open_store(url: str, *, namespace: str = DEFAULT_NAMESPACE, **options: Any) -> BlockStore:
    """The store ``url`` names, opened by its scheme's function; ``options`` are defaults its query overrides."""
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError("namespace must be a non-empty string")
    parsed = parse_store_url(url)
    module, _, function = STORE_SCHEMES[parsed.scheme].partition(":")
    opener = getattr(importlib.import_module(module), function)
    return opener(parsed, namespace=namespace, **options)


EMBEDDED_PARAMS = ("memory", "memory_codec", "disk", "disk_codec", "eviction", "durable")


def open_embedded_url(url: TierURL, *, namespace: str, **options: Any) -> BlockStore:
    """``embedded://[PATH]?memory=SIZE|0&memory_codec=C&disk=SIZE&disk_codec=C&eviction=P&durable=BOOL``: the
    embedded store (``open_embedded_store``) in ``PATH`` (empty: the default data directory); ``memory=0``: no
    memory tier."""
    from kvshelf.kvstore.embedded import DEFAULT_MEMORY_BYTES, open_embedded_store

    memory = url.take_size("memory", options.pop("memory_bytes", DEFAULT_MEMORY_BYTES))
    kwargs: dict[str, Any] = {
        "memory_bytes": memory or None,
        "memory_codec": url.take("memory_codec", options.pop("memory_codec", "raw")),
        "disk_codec": url.take("disk_codec", options.pop("disk_codec", "raw")),
        "eviction_policy": url.take("eviction", options.pop("eviction_policy", "prefix")),
        "durable": url.take_bool("durable", options.pop("durable", True)),
    }
    disk = url.take_size("disk", None)
    if disk is not None:
        kwargs["max_disk_bytes"] = disk
    url.done(EMBEDDED_PARAMS)
    return open_embedded_store(url.location or None, namespace=namespace, **kwargs, **options)


def open_redis_url(url: TierURL, *, namespace: str, **options: Any) -> BlockStore:
    """``redis://...?codec=C&prefix=P`` (and the other Redis schemes of ``kvstore.tier_registry``): a
    ``TieredStore`` over one Redis tier holding blocks in codec ``C`` (default ``raw``) under key prefix ``P``
    (default ``kvshelf:``); the tier's own (TLS) parameters pass through."""
    from kvshelf.kvstore.codec import get_codec
    from kvshelf.kvstore.store import TieredStore, TierSpec
    from kvshelf.kvstore.tier_registry import open_tier

    codec = url.take("codec", options.pop("codec", "raw"))
    get_codec(codec)
    prefix = url.take("prefix")
    if prefix is not None:
        options["prefix"] = prefix
    tier_url = url.url.split("?", 1)[0]
    if url.query:
        from urllib.parse import urlencode

        tier_url += "?" + urlencode(url.query)
    tier = open_tier(tier_url, **options)
    return TieredStore([TierSpec(tier, codec)], namespace=namespace)
