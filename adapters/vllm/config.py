"""The connector's settings, read from vLLM's ``kv_connector_extra_config`` (a JSON object of these keys):

* ``store``: a store URL (``kvstore.store_url``): ``embedded://PATH?memory=1GiB&disk_codec=int8`` (the default,
  ``embedded://``, is the embedded store in the default data directory), ``grpc://HOST:PORT?token=T`` (a
  ``kvshelf serve`` shared by several engines), ``redis://HOST:PORT/DB?codec=zstd``. Each tier's codec is a parameter
  of the URL (``memory_codec``, ``disk_codec``, ``codec``).
* ``namespace``: the tenant the blocks belong to (default ``"default"``); it is part of every key.
* ``block_tokens``: tokens per kvshelf block, a multiple of vLLM's block size (default 256, kvshelf's prefix-block
  size, so ``CachedGenerator`` finds the same blocks under the same keys).
* ``max_pending_blocks``: the write-behind queue's bound in blocks (default 64): decoding waits only when the store
  falls this far behind.
* ``load_failure_policy``: what vLLM does with a block that fails to load: ``"recompute"`` (the default: the
  connector sets vLLM's ``kv_load_failure_policy`` to it, so a damaged, foreign or evicted block costs a recompute,
  never an answer) or ``"fail"`` (vLLM's own default: the request ends with an error).

Anything else (an unknown key, a bad URL or codec, a size that is not a multiple) is a ``ConfigError`` of one line
at engine start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvshelf.kvstore.errors import ConfigError

DEFAULT_STORE = "embedded://"
DEFAULT_BLOCK_TOKENS = 256
DEFAULT_MAX_PENDING_BLOCKS = 64
POLICIES = ("recompute", "fail")
_PREFIX = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorSettings:
    store: str = DEFAULT_STORE
    namespace: str = "default"
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS
    load_failure_policy: str = "recompute"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """The settings ``extra`` names (``None`` or ``{}``: the defaults); ``ConfigError`` naming the bad key."""
        extra = dict(extra or {})
        known = tuple(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(f"{_PREFIX}: unknown key(s) {', '.join(map(repr, unknown))}; kvshelf's connector "
                              f"accepts {', '.join(known)}")
        store = extra.get("store", DEFAULT_STORE)
        if not isinstance(store, str) or "://" not in store:
            raise ConfigError(f"{_PREFIX}: store must be a store URL such as 'embedded:///path' or "
                              f"'grpc://host:port', got {store!r}")
        namespace = extra.get("namespace", "default")
        if not isinstance(namespace, str) or not namespace:
            raise ConfigError(f"{_PREFIX}: namespace must be a non-empty string, got {namespace!r}")
        block_tokens = _positive_int(extra, "block_tokens", DEFAULT_BLOCK_TOKENS)
        pending = _positive_int(extra, "max_pending_blocks", DEFAULT_MAX_PENDING_BLOCKS)
        policy = extra.get("load_failure_policy", "recompute")
        if policy not in POLICIES:
            raise ConfigError(f"{_PREFIX}: load_failure_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        return cls(store, namespace, block_tokens, pending, policy)

    def check_block_size(self, vllm_block_size: int) -> None:
        """``block_tokens`` must be a whole number of vLLM blocks (pages move whole)."""
        if self.block_tokens % vllm_block_size:
            raise ConfigError(f"{_PREFIX}: block_tokens={self.block_tokens} is not a multiple of vLLM's block size "
                              f"{vllm_block_size} (kvshelf blocks are made of whole vLLM pages)")


def _positive_int(extra: dict[str, Any], name: str, default: int) -> int:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{_PREFIX}: {name} must be a positive integer, got {value!r}")
    return value
