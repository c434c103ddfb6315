"""Store keys of reusable contexts, all built on ``kvstore.keys.chunk_key`` (BLAKE2b; never Python's ``hash``).

* a RAG chunk (TurboRAG): ``chunk_key(fp, ns, tokens)``, the KV computed alone at position 0;
* a block encoded after a shared prefix (Block-Attention): ``chunk_key(fp, ns, [BLOCK, *prefix, SEP, *block])``;
* a prompt module (Prompt Cache): ``chunk_key(fp, ns, [MODULE, n, *tokens, *positions, *scope])``: the tokens,
  their schema positions and the tokens of the modules it was encoded after.

The negative markers never occur as token ids, so the three families cannot collide.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvshelf.kvstore.keys import chunk_key

BLOCK, MODULE, SEP = -1, -2, -3


def rag_chunk_key(fingerprint: str, namespace: str, tokens: Sequence[int]) -> bytes:
    return chunk_key(fingerprint, namespace, tokens)


def prefixed_block_key(fingerprint: str, namespace: str, prefix: Sequence[int], tokens: Sequence[int]) -> bytes:
    return chunk_key(fingerprint, namespace, [BLOCK, *prefix, SEP, *tokens])


def prefix_digest(prefix: Sequence[int]) -> str:
    """A short name of a shared prefix's token ids (16 hex digits of BLAKE2b), for messages and summaries."""
    h = hashlib.blake2b(digest_size=8)
    for token in prefix:
        h.update(int(token).to_bytes(8, "little", signed=True))
    return h.hexdigest()


def module_key(
    fingerprint: str, namespace: str, tokens: Sequence[int], positions: Sequence[int], scope: Sequence[int] = ()
) -> bytes:
    return chunk_key(fingerprint, namespace, [MODULE, len(tokens), *tokens, *positions, SEP, *scope])
