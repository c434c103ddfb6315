"""Tiers by URL: one registry from a URL scheme to the module that opens a tier of it.

    open_tier("memory://?capacity=2GiB")                       # MemoryTier
    open_tier("lmdb:///var/lib/kvshelf/lmdb?capacity=100GiB")   # LMDBTier in that directory
    open_tier("redis://cache:6379/0", socket_timeout=1.0)       # RedisTier (also rediss://, redis+cluster://,
                                                                 # rediss+cluster://)

``open_embedded_store`` (kvstore/embedded.py) and ``kvshelf serve`` (service/serve.py) build their tiers here, so
both accept the same URLs. Keyword options are the caller's defaults (sizes in bytes); a URL's query parameters
override them. A bad URL is a ``ConfigError`` naming the URL and what is wrong (an unknown scheme lists the known
ones).

Adding a backend: one module with ``open_url(url: TierURL, **options) -> Tier`` (read its query parameters with
``url.take_*``, call ``url.done()``, return the tier) plus one line in ``SCHEMES``; the tier contract suite
(tests/kvstore/test_tier_contract.py) then runs against the new scheme (docs/extending.md, "Adding a tier").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.tier import Tier

#: scheme -> "module:function" opening a tier of it (imported on first use)
SCHEMES: dict[str, str] = {
    "memory": "kvshelf.kvstore.memory_url:open_url",
    "lmdb": "kvshelf.kvstore.lmdb_tier.tier:open_url",
    "redis": "kvshelf.kvstore.redis_tier.tier:open_url",
    "rediss": "kvshelf.kvstore.redis_tier.tier:open_url",
    "redis+cluster": "kvshelf.kvstore.redis_tier.tier:open_url",
    "rediss+cluster": "kvshelf.kvstore.redis_tier.tier:open_url",
}


def known_schemes(schemes: dict[str, str] | None = None) -> str:
    """``schemes`` (default: the tier schemes) as ``a://, b://`` for error messages."""
    return ", ".join(f"{scheme}://" for scheme in (SCHEMES if schemes is None else schemes))


@dataclass
class TierURL:
    """A parsed URL: ``scheme://location?query``; the opener takes its query parameters one by one. ``kind`` names
    what the URL is for in error messages (``"tier"`` here, ``"store"`` for ``kvstore.store_url``)."""

    url: str
    scheme: str
    location: str  # everything between ``scheme://`` and ``?`` (percent-decoded: a host, a path, or nothing)
    query: dict[str, str] = field(default_factory=dict)
    kind: str = "tier"

    @classmethod
    def parse(cls, url: str, schemes: dict[str, str] | None = None, kind: str = "tier") -> TierURL:
        """``url`` split into scheme, location and query; ``ConfigError`` for a non-URL, a scheme not in
        ``schemes`` (default: the tier schemes) or a parameter given twice."""
        schemes = SCHEMES if schemes is None else schemes
        known = known_schemes(schemes)
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(f"{kind} URL {url!r}: not a URL (SCHEME://...); known schemes: {known}")
        scheme, rest = url.split("://", 1)
        scheme = scheme.lower()
        if scheme not in schemes:
            raise ConfigError(f"{kind} URL {url!r}: unknown scheme {scheme + '://'!r}; known schemes: {known}")
        location, _, query = rest.partition("?")
        params: dict[str, str] = {}
        for name, value in parse_qsl(query, keep_blank_values=True):
            if name in params:
                raise ConfigError(f"{kind} URL {url!r}: parameter {name!r} given twice")
            params[name] = value
        return cls(url, scheme, unquote(location), params, kind)

    def error(self, what: str) -> ConfigError:
        return ConfigError(f"{self.kind} URL {self.url!r}: {what}")

    def take(self, name: str, default: Any = None) -> Any:
        """The query parameter ``name`` as text (``default`` when absent), removed from the query."""
        return self.query.pop(name, default)

    def take_size(self, name: str, default: int | None) -> int | None:
        from kvshelf.kvstore.sizes import parse_size

        text = self.take(name)
        if text is None:
            return default
        try:
            return parse_size(text, name)
        except ConfigError as exc:
            raise self.error(str(exc)) from None

    def take_float(self, name: str, default: float | None) -> float | None:
        text = self.take(name)
        if text is None:
            return default
        try:
            value = float(text)
        except ValueError:
            raise self.error(f"{name} must be a number, got {text!r}") from None
        if not 0 < value < float("inf"):
            raise self.error(f"{name} must be > 0, got {text!r}")
        return value

    def take_bool(self, name: str, default: bool) -> bool:
        text = self.take(name)
        if text is None:
            return default
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise self.error(f"{name} must be true or false, got {text!r}")

    def done(self, accepted: tuple[str, ...]) -> None:
        """Fail on query parameters nobody took (``accepted``: the names this scheme knows)."""
        if self.query:
            raise self.error(f"unknown parameter(s) {', '.join(map(repr, self.query))}; {self.scheme}:// accepts "
                             f"{', '.join(accepted) or 'none'}")


def open_tier(url: str, **options: Any) -> Tier:
    """The tier ``url`` names, opened by its scheme's module; ``options`` are defaults its query overrides."""
    parsed = TierURL.parse(url)
    module, _, function = SCHEMES[parsed.scheme].partition(":")
    opener = getattr(importlib.import_module(module), function)
    return opener(parsed, **options)


def lmdb_url(path: Any) -> str:
    """``lmdb://PATH`` for a directory (``%``, ``?`` and ``#`` quoted)."""
    from urllib.parse import quote

    return "lmdb://" + quote(str(path), safe="/:~+@,=-_.")
