"""A get's values, read by the store a few at a time as they are sent, each key once however often it is named;
the leading run of hits counted as a reused prefix (``service/hot_prefixes.py``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvshelf.kvstore.keys import ScopedKey, unscope
from kvshelf.kvstore.store import TieredStore
from kvshelf.service.hot_prefixes import HotPrefixes

#: What a get reads ahead of what it has sent: its first read is one value; each later one as many keys as fit this
#: many bytes, judged by the values read so far (at most ``READ_BATCH_KEYS``), so a get holds about this much plus
#: one value, however large its values.
READ_AHEAD_BYTES = 32 << 20
READ_BATCH_KEYS = 16
#: A value a get names again later is kept for it (read once) while the values kept add up to at most this many
#: bytes, and always the first one; past that it is read again where it is named again.
REPEAT_KEEP_BYTES = 16 << 20


class Reader:
    """The gets of one store, with the count of the most reused prefixes of each namespace."""

    def __init__(self, store: TieredStore, hot_prefixes: HotPrefixes) -> None:
        self.store = store
        self.hot_prefixes = hot_prefixes

    def served(self, keys: Sequence[ScopedKey], namespace: str, fingerprint: str | None,
               tokens: Sequence[int]) -> Iterator[tuple[int, ScopedKey, bytes | None]]:
        """``(index, tier key, value or None)`` of the scoped ``keys``, in order, checked by the store; the leading
        run of hits is counted as a reused prefix (``tokens``: tokens per key, when the client sent them).

        Memory is bounded whatever the request names: values are read a few at a time as they are sent (about
        ``READ_AHEAD_BYTES`` ahead), and a key named more than once is read once and its value kept for its later
        places (within ``REPEAT_KEEP_BYTES``), so naming one key many times costs neither reads nor copies."""
        last = {key: index for index, key in enumerate(keys)}  # the last place each key is named at
        kept: dict[ScopedKey, bytes | None] = {}  # values named again later in this request
        kept_bytes = 0
        read_values, read_bytes = 0, 0  # hits read so far (what sizes the next read)
        run = 0  # the leading run of served keys: the reused prefix (counted in hot_prefixes when it ends)
        index, want = 0, 1
        while index < len(keys):
            end, got = self._read_round(keys, index, want, kept, namespace, fingerprint, tokens)
            for value in got.values():
                if value is not None:
                    read_values, read_bytes = read_values + 1, read_bytes + len(value)
            for position in range(index, end):
                tier_key = keys[position]
                value = got[tier_key] if tier_key in got else kept[tier_key]
                if last[tier_key] == position:
                    if tier_key in kept:
                        kept_bytes -= len(kept.pop(tier_key) or b"")
                elif tier_key not in kept and (not kept_bytes or kept_bytes + len(value or b"") <= REPEAT_KEEP_BYTES):
                    kept[tier_key] = value
                    kept_bytes += len(value or b"")
                if run == position and value is not None:
                    run += 1
                elif run == position and run:  # the first miss ends the reused prefix
                    self.count_prefix(namespace, keys, run, tokens)
                yield position, tier_key, value
            del got, value
            index = end
            want = (READ_BATCH_KEYS if not read_values else
                    max(1, min(READ_BATCH_KEYS, READ_AHEAD_BYTES * read_values // max(read_bytes, 1))))
        if run == len(keys) and run:  # every key served: the whole request was a reused prefix
            self.count_prefix(namespace, keys, run, tokens)

    def _read_round(self, keys: Sequence[ScopedKey], index: int, want: int, kept: dict[ScopedKey, bytes | None],
                    namespace: str, fingerprint: str | None,
                    tokens: Sequence[int]) -> tuple[int, dict[ScopedKey, bytes | None]]:
        """``(end, values)``: the keys from ``index`` to ``end`` are served next; ``values`` are those read now (at
        most ``want`` keys, each once; keys in ``kept`` are not read again)."""
        batch: dict[ScopedKey, int] = {}  # the keys read now (each once) -> its first place in this round
        end = index
        while end < len(keys) and (keys[end] in kept or keys[end] in batch or len(batch) < want):
            if keys[end] not in kept and keys[end] not in batch:
                batch[keys[end]] = end
            end += 1
        if not batch:
            return end, {}
        per_key_tokens = len(tokens) == len(keys)
        values = self.store.get_encoded_many(list(batch), namespace=namespace, fingerprint=fingerprint,
                                             tokens=[tokens[i] for i in batch.values()] if per_key_tokens else None)
        return end, dict(zip(batch, values, strict=True))

    def count_prefix(self, namespace: str, keys: Sequence[ScopedKey], depth: int,
                     tokens: Sequence[int] | None) -> None:
        """One reuse of the prefix of ``keys[:depth]`` (``tokens``: the request's tokens per key, if it sent them)."""
        length = sum(tokens[:depth]) if tokens is not None and len(tokens) == len(keys) else None
        self.hot_prefixes.hit(namespace, unscope(keys[depth - 1]), depth, length)
