"""Content-addressed block keys, stable across processes and machines.

Prefix blocks chain (as in vLLM's prefix caching): ``key_i = H(fingerprint, namespace, key_{i-1}, tokens_i)``,
so a key names the whole prefix up to and including its block. Position-independent chunks use
``H(fingerprint, namespace, "chunk", tokens)``. ``H`` is BLAKE2b with a 16-byte digest over length-prefixed
fields; Python's ``hash`` is never used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from kvshelf.kvstore.errors import ConfigError

KEY_BYTES = 16
_ROOT = b"\x00" * KEY_BYTES


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def _digest(*fields: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvshelf-key-v1")
    for f in fields:
        h.update(len(f).to_bytes(8, "little"))
        h.update(f)
    return h.digest()


def _check(fingerprint: str, namespace: str) -> None:
    if not fingerprint:
        raise ConfigError("a model fingerprint is required to build block keys")
    if not namespace:
        raise ConfigError("namespace must be a non-empty string")


def block_key(fingerprint: str, namespace: str, parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Key of one prefix block given its parent's key (``None`` for the first block)."""
    _check(fingerprint, namespace)
    return _digest(b"prefix", fingerprint.encode(), namespace.encode(), parent or _ROOT, _tokens_bytes(tokens))


class BlockSpan(NamedTuple):
    """One chained prefix block: tokens ``[start, end)`` of the prompt and the block's ``key``."""

    start: int
    end: int
    key: bytes


def prefix_block_spans(
    fingerprint: str, namespace: str, tokens: Sequence[int], block_size: int, *, partial: bool = False
) -> list[BlockSpan]:
    """The chained blocks of ``tokens``: every full block of ``block_size`` tokens, plus with ``partial`` the
    trailing shorter one (the end of a context marked cacheable), each as ``(start, end, key)``."""
    if block_size <= 0:
        raise ConfigError(f"block_size must be > 0, got {block_size}")
    spans: list[BlockSpan] = []
    parent: bytes | None = None
    stop = len(tokens) if partial else len(tokens) - block_size + 1
    for start in range(0, stop, block_size):
        end = min(start + block_size, len(tokens))
        parent = block_key(fingerprint, namespace, parent, tokens[start:end])
        spans.append(BlockSpan(start, end, parent))
    return spans


def prefix_block_keys(
    fingerprint: str, namespace: str, tokens: Sequence[int], block_size: int, *, partial: bool = False
) -> list[bytes]:
    """Chained keys of every full block of ``tokens`` (and with ``partial`` of the trailing shorter one)."""
    return [span.key for span in prefix_block_spans(fingerprint, namespace, tokens, block_size, partial=partial)]


def chunk_key(fingerprint: str, namespace: str, tokens: Sequence[int]) -> bytes:
    """Key of a position-independent chunk (a RAG chunk or prompt module), stored at position 0."""
    _check(fingerprint, namespace)
    return _digest(b"chunk", fingerprint.encode(), namespace.encode(), _tokens_bytes(tokens))


def state_key(boundary_key: bytes) -> bytes:
    """Key of the recurrent-state snapshot taken at a prefix block boundary: ``H("state", key)`` of the chained key
    of the block that ends there (``kvstore.snapshot``). It names the same prefix, model and namespace as the
    block's key, and never collides with a block key."""
    if not isinstance(boundary_key, bytes) or len(boundary_key) != KEY_BYTES:
        raise ConfigError(f"a state key derives from a {KEY_BYTES}-byte block key")
    return _digest(b"state", boundary_key)


#: the ``KVBlock.extra`` entry naming a prefix block's parent key (hex) in its chain: set by the generate adapter,
#: passed on by the service in the block's BlockStored events (``service/events.py``)
PARENT_EXTRA = "parent"

#: bytes of the tag the service puts before a block key to scope it to a namespace (``service.auth.scope_tag``)
SCOPE_BYTES = 8


def check_keys(keys: Iterable[bytes], *, scoped: bool = False) -> list[bytes]:
    """``keys`` as a list; ``ConfigError`` unless each is a block key (``KEY_BYTES``), or with ``scoped`` also a
    tier key scoped by the service (``SCOPE_BYTES + KEY_BYTES``)."""
    keys = list(keys)
    lengths = (KEY_BYTES, SCOPE_BYTES + KEY_BYTES) if scoped else (KEY_BYTES,)
    for key in keys:
        if not isinstance(key, bytes) or len(key) not in lengths:
            got = f"one of {len(key)}" if isinstance(key, bytes) else f"a {type(key).__name__}"
            raise ConfigError(f"block keys are {KEY_BYTES} bytes, got {got}")
    return keys
