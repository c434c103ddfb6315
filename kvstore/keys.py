"""Content-addressed block keys, stable across processes and machines.

Prefix blocks chain (as in vLLM's prefix caching): ``key_i = H(fingerprint, namespace, key_{i-1}, tokens_i)``,
so a key names the whole prefix up to and including its block. Position-independent chunks use
``H(fingerprint, namespace, "chunk", tokens)``. ``H`` is BLAKE2b with a 16-byte digest over length-prefixed
fields; Python's ``hash`` is never used.

Two kinds of key, told apart by type (``NewType``s of ``bytes``, free at run time):

* ``BlockKey``: the ``KEY_BYTES``-byte key of a block, the one its encoded header names and clients send.
* ``ScopedKey``: a block key as the service stores it in a tier, scoped to a namespace: the namespace's
  ``SCOPE_BYTES``-byte ``ScopeTag`` (``scope_tag``) then the block key. One namespace's scoped keys never equal
  another's, so a tenant can never read, test, pin, list or delete another's blocks.

``scope`` / ``unscope`` / ``scope_of`` / ``split_scoped`` / ``block_key_of`` are the only places a key is cut or
joined at a fixed offset (a test checks that no other module slices a key by ``KEY_BYTES`` or ``SCOPE_BYTES``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple, NewType, TypeAlias, cast

import numpy as np

from kvshelf.kvstore.errors import ConfigError

KEY_BYTES = 16
_ROOT = b"\x00" * KEY_BYTES

#: a block's key (``KEY_BYTES`` bytes): what its header names and what clients send
BlockKey = NewType("BlockKey", bytes)
#: the tag of one namespace (``SCOPE_BYTES`` bytes) that scopes its blocks' tier keys (``scope_tag``)
ScopeTag = NewType("ScopeTag", bytes)
#: a block key scoped to a namespace, as the service stores it in a tier: ``ScopeTag`` + ``BlockKey``
ScopedKey = NewType("ScopedKey", bytes)
#: a key as a tier holds it: a bare block key (an embedded store) or a scoped one (the service)
TierKey: TypeAlias = BlockKey | ScopedKey


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


def block_key(fingerprint: str, namespace: str, parent: bytes | None, tokens: Sequence[int]) -> BlockKey:
    """Key of one prefix block given its parent's key (``None`` for the first block)."""
    _check(fingerprint, namespace)
    fields = (fingerprint.encode(), namespace.encode(), parent or _ROOT, _tokens_bytes(tokens))
    return BlockKey(_digest(b"prefix", *fields))


class BlockSpan(NamedTuple):
    """One chained prefix block: tokens ``[start, end)`` of the prompt and the block's ``key``."""

    start: int
    end: int
    key: BlockKey


def prefix_block_spans(
    fingerprint: str, namespace: str, tokens: Sequence[int], block_size: int, *, partial: bool = False
) -> list[BlockSpan]:
    """The chained blocks of ``tokens``: every full block of ``block_size`` tokens, plus with ``partial`` the
    trailing shorter one (the end of a context marked cacheable), each as ``(start, end, key)``."""
    if block_size <= 0:
        raise ConfigError(f"block_size must be > 0, got {block_size}")
    spans: list[BlockSpan] = []
    parent: BlockKey | None = None
    stop = len(tokens) if partial else len(tokens) - block_size + 1
    for start in range(0, stop, block_size):
        end = min(start + block_size, len(tokens))
        parent = block_key(fingerprint, namespace, parent, tokens[start:end])
        spans.append(BlockSpan(start, end, parent))
    return spans


def prefix_block_keys(
    fingerprint: str, namespace: str, tokens: Sequence[int], block_size: int, *, partial: bool = False
) -> list[BlockKey]:
    """Chained keys of every full block of ``tokens`` (and with ``partial`` of the trailing shorter one)."""
    return [span.key for span in prefix_block_spans(fingerprint, namespace, tokens, block_size, partial=partial)]


def chunk_key(fingerprint: str, namespace: str, tokens: Sequence[int]) -> BlockKey:
    """Key of a position-independent chunk (a RAG chunk or prompt module), stored at position 0."""
    _check(fingerprint, namespace)
    return BlockKey(_digest(b"chunk", fingerprint.encode(), namespace.encode(), _tokens_bytes(tokens)))


def state_key(boundary_key: bytes) -> BlockKey:
    """Key of the recurrent-state snapshot taken at a prefix block boundary: ``H("state", key)`` of the chained key
    of the block that ends there (``kvstore.snapshot``). It names the same prefix, model and namespace as the
    block's key, and never collides with a block key."""
    if not isinstance(boundary_key, bytes) or len(boundary_key) != KEY_BYTES:
        raise ConfigError(f"a state key derives from a {KEY_BYTES}-byte block key")
    return BlockKey(_digest(b"state", boundary_key))


def layer_block_key(block: bytes, layer: int) -> BlockKey:
    """Key of one layer's part of a chained block (tier-backed sparse attention stores each layer's KV of a block
    apart, so that a layer fetches only what it attends to): ``H("layer", key, layer)`` of the block's chained key.
    It names the same prefix, model and namespace as the block's key, and never collides with a block key."""
    if not isinstance(block, bytes) or len(block) != KEY_BYTES:
        raise ConfigError(f"a layer block key derives from a {KEY_BYTES}-byte block key")
    if layer < 0:
        raise ConfigError(f"layer must be >= 0, got {layer}")
    return BlockKey(_digest(b"layer", block, int(layer).to_bytes(4, "little")))


#: the ``KVBlock.extra`` entry naming the model a block was made by (``adapters.model_label``): shown by dashboards
#: and stats, never part of a key or a check
MODEL_NAME_EXTRA = "model_name"
#: the ``KVBlock.extra`` entry naming a prefix block's parent key (hex) in its chain: set by the generate adapter,
#: passed on by the service in the block's BlockStored events (``service/events.py``)
PARENT_EXTRA = "parent"


def parent_of(extra: dict[str, str]) -> bytes:
    """The parent key a block's ``extra`` names (``PARENT_EXTRA``, hex), else b"": advisory only (KV events carry
    it), so a malformed one is ignored."""
    try:
        parent = bytes.fromhex(extra.get(PARENT_EXTRA, ""))
    except ValueError:
        return b""
    return parent if len(parent) == KEY_BYTES else b""

#: bytes of the tag the service puts before a block key to scope it to a namespace (``scope_tag``)
SCOPE_BYTES = 8
#: bytes of a scoped tier key (``ScopedKey``): a scope tag then a block key
SCOPED_KEY_BYTES = SCOPE_BYTES + KEY_BYTES


def scope_tag(namespace: str) -> ScopeTag:
    """The ``SCOPE_BYTES``-byte BLAKE2b tag of ``namespace`` that starts each of its scoped keys."""
    return ScopeTag(hashlib.blake2b(namespace.encode(), digest_size=SCOPE_BYTES, person=b"kvshelf-scope-v1").digest())


def scope(tag: ScopeTag, key: BlockKey) -> ScopedKey:
    """``key`` as a tier stores it in the namespace of ``tag``: the tag, then the block key. ``ConfigError``
    unless ``tag`` is ``SCOPE_BYTES`` bytes and ``key`` ``KEY_BYTES``."""
    if len(tag) != SCOPE_BYTES or len(key) != KEY_BYTES:
        raise ConfigError(f"a scoped key is a {SCOPE_BYTES}-byte tag and a {KEY_BYTES}-byte block key, "
                          f"got {len(tag)} and {len(key)} bytes")
    return ScopedKey(tag + key)


def is_scoped(key: bytes) -> bool:
    """Whether ``key`` has the length of a scoped key (the service's), rather than a bare block key's."""
    return len(key) == SCOPED_KEY_BYTES


def _check_scoped(key: bytes) -> None:
    if len(key) != SCOPED_KEY_BYTES:
        raise ConfigError(f"a scoped key is {SCOPED_KEY_BYTES} bytes, got {len(key)}")


def unscope(key: ScopedKey) -> BlockKey:
    """The block key of a scoped key (its tag dropped): what the block's header names and clients know it by.
    ``ConfigError`` unless ``key`` is ``SCOPED_KEY_BYTES`` bytes."""
    _check_scoped(key)
    return BlockKey(key[SCOPE_BYTES:])


def scope_of(key: ScopedKey) -> ScopeTag:
    """The namespace tag a scoped key starts with. ``ConfigError`` unless ``key`` is ``SCOPED_KEY_BYTES`` bytes."""
    _check_scoped(key)
    return ScopeTag(key[:SCOPE_BYTES])


def split_scoped(key: ScopedKey) -> tuple[ScopeTag, BlockKey]:
    """``(scope_of(key), unscope(key))`` in one step."""
    _check_scoped(key)
    return ScopeTag(key[:SCOPE_BYTES]), BlockKey(key[SCOPE_BYTES:])


def block_key_of(tier_key: bytes) -> BlockKey:
    """The block key a tier key names, the one in its value's header: a scoped key's last ``KEY_BYTES`` bytes, a
    bare block key as it is (a store takes both: ``check_keys(..., scoped=True)``)."""
    return BlockKey(tier_key[-KEY_BYTES:])


def key_low64(key: bytes) -> int:
    """A block key's last 8 bytes as an unsigned big-endian int (the int form of a block hash vLLM's KV events
    carry: ``kvstore.vllm_events``)."""
    return int.from_bytes(key[-8:], "big")


def given_back(keys: Iterable[bytes]) -> list[TierKey]:
    """Keys a tier or a store gave back (listed, evicted, pinned), typed as the tier keys they are (nothing is
    checked: they were checked on the way in)."""
    return cast("list[TierKey]", list(keys))


#: the lengths a store's tier key may have: a bare block key, or a scoped one
TIER_KEY_LENGTHS = (KEY_BYTES, SCOPED_KEY_BYTES)


def check_keys(keys: Iterable[bytes], *, scoped: bool = False) -> list[TierKey]:
    """``keys`` as a list; ``ConfigError`` unless each is a block key (``KEY_BYTES``), or with ``scoped`` also a
    tier key scoped by the service (``SCOPED_KEY_BYTES``)."""
    keys = list(keys)
    lengths = TIER_KEY_LENGTHS if scoped else (KEY_BYTES,)
    for key in keys:
        if not isinstance(key, bytes) or len(key) not in lengths:
            got = f"one of {len(key)}" if isinstance(key, bytes) else f"a {type(key).__name__}"
            raise ConfigError(f"block keys are {KEY_BYTES} bytes, got {got}")
    return cast("list[TierKey]", keys)
