"""Model fingerprints: a stable digest of everything that makes KV caches interchangeable.

Two models share a fingerprint only if their architecture, layer count, KV heads, head dim, RoPE parameters,
cache dtype and a sample of their weights agree; a block is never served to another fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

FINGERPRINT_HEX_CHARS = 32


def fingerprint_from_properties(properties: Mapping[str, Any], weight_digest: bytes) -> str:
    """Hex digest of JSON-canonicalised ``properties`` plus ``weight_digest`` (bytes of sampled weights' hash)."""
    canonical = json.dumps(properties, sort_keys=True, separators=(",", ":"), default=str).encode()
    h = hashlib.blake2b(digest_size=FINGERPRINT_HEX_CHARS // 2, person=b"kvshelf-fp-v1")
    h.update(canonical)
    h.update(weight_digest)
    return h.hexdigest()
