"""Tenancy for the gRPC service: bearer tokens mapped to namespaces, and the namespace scope of tier keys.

A tokens file is TOML::

    [tokens]
    "s3cret-token-of-team-a" = "team-a"
    "another-token" = "team-b"

With one, every call must carry ``authorization: Bearer <token>`` metadata (one such header; the scheme in any
case, RFC 6750 / RFC 9110) and works in that token's namespace. Without one (dev mode) a call works in the
namespace its request names. ``bearer_token`` is the one reading of that header, for auth and fairness alike.
"""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import scope_tag as scope_tag  # the namespace scope of tier keys lives in kvstore.keys
from kvshelf.service.errors import BearerError

MAX_NAMESPACE_CHARS = 256


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str:
    """The token of a call's ``authorization: Bearer <token>`` metadata (the header name and the scheme in any
    case). Raises ``BearerError`` when there is no such header, it is not a bearer token, it is empty, or the call
    carries two ``authorization`` headers (which one counts would be ambiguous: refused)."""
    values = [v for k, v in metadata or () if k.lower() == "authorization"]
    if not values:
        raise BearerError("missing 'authorization: Bearer <token>' metadata")
    if len(values) > 1:
        raise BearerError(f"{len(values)} 'authorization' headers; send exactly one")
    value = values[0]
    if not isinstance(value, str):
        raise BearerError("the 'authorization' header is binary; send 'Bearer <token>' as text")
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise BearerError(f"the 'authorization' header's scheme is {scheme[:20]!r}; expected 'Bearer <token>'")
    if not token.strip():
        raise BearerError("the 'authorization' header carries an empty bearer token")
    return token.strip()


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """Bearer token -> namespace. Tokens are kept only as SHA-256 digests and compared in constant time."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        if not tokens:
            raise ConfigError("the tokens table is empty: add '\"<token>\" = \"<namespace>\"' lines under [tokens]")
        self._by_digest: dict[bytes, str] = {}
        for token, namespace in tokens.items():
            if not isinstance(token, str) or len(token) < 8:
                raise ConfigError("every token must be a string of at least 8 characters")
            if not isinstance(namespace, str) or not namespace or len(namespace) > MAX_NAMESPACE_CHARS:
                raise ConfigError(f"token namespaces must be 1..{MAX_NAMESPACE_CHARS} characters, got {namespace!r}")
            self._by_digest[_digest(token)] = namespace

    @classmethod
    def from_file(cls, path: str | Path) -> TokenTable:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read tokens file {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"tokens file {path} is not valid TOML: {exc}") from exc
        tokens = data.get("tokens")
        if not isinstance(tokens, dict):
            raise ConfigError(f"tokens file {path} needs a [tokens] table of \"token\" = \"namespace\"")
        return cls(tokens)

    def namespace_of(self, token: str) -> str | None:
        """The namespace of ``token``, or None for an unknown token."""
        wanted = _digest(token)
        found = None
        for digest, namespace in self._by_digest.items():  # constant time in the token's value
            if hmac.compare_digest(digest, wanted):
                found = namespace
        return found

    def __len__(self) -> int:
        return len(self._by_digest)
