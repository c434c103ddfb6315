"""The pinned keys of a store: never evicted from any tier, and kept to the blocks some tier holds (a pinned key
that no tier holds any more, evicted where a pin could not keep it, refused, dropped as damaged, evicted by
Redis, loses its pin)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvshelf.kvstore.errors import TierDamagedError, TierUnavailableError
from kvshelf.kvstore.keys import TierKey, given_back
from kvshelf.kvstore.tiered.codecs import TierSpec


class PinSet:
    """The pins over ``specs``' tiers: each pin is told to every tier (``Tier.pin``), which never evicts it."""

    def __init__(self, specs: Sequence[TierSpec]) -> None:
        self._specs = list(specs)
        self._pinned: set[bytes] = set()
        self._loss_epochs: dict[str, int] = {}  # tier -> its loss_epoch when the pins were last checked
        self._lock = threading.Lock()
        for spec in self._specs:
            spec.tier.pin(self._pinned)

    def pin(self, keys: Sequence[TierKey]) -> None:
        """Pin ``keys`` in every tier (held or not: the caller decides)."""
        with self._lock:
            self._pinned.update(keys)
        for spec in self._specs:
            spec.tier.pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Unpin ``keys``; return how many distinct keys were pinned."""
        with self._lock:
            was = self._pinned.intersection(keys)
            self._pinned.difference_update(was)
        for spec in self._specs:
            spec.tier.unpin(keys)
        return len(was)

    def is_pinned(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pinned

    def keys(self) -> list[bytes]:
        """Every pinned key (a snapshot)."""
        with self._lock:
            return list(self._pinned)

    def with_prefix(self, prefix: bytes, length: int | None) -> list[bytes]:
        """The pinned keys starting with ``prefix`` (of ``length`` bytes when given)."""
        with self._lock:
            return [k for k in self._pinned if k.startswith(prefix) and (length is None or len(k) == length)]

    def forget(self, keys: Iterable[bytes]) -> None:
        """Unpin those of ``keys`` that are pinned and that no tier holds any more, so the pinned set names only
        held blocks. A tier that cannot be asked (unreachable) may hold it: the pin stays."""
        with self._lock:
            pinned = [key for key in dict.fromkeys(keys) if key in self._pinned]
        gone = [key for key in pinned if not self._held_somewhere(key)]
        if gone:
            self.unpin(gone)

    def _held_somewhere(self, key: bytes) -> bool:
        for spec in self._specs:
            try:
                if spec.tier.prefix_run_length(given_back([key])) == 1:
                    return True
            except (TierUnavailableError, TierDamagedError):
                return True
        return False

    def check_after_losses(self) -> None:
        """Every pin checked again (``forget``) when a tier says it lost values without reporting each one (its
        ``loss_epoch`` grew: a Redis tier rebuilt its usage registry, which Redis had evicted): rare, and then
        one ``prefix_run_length`` per pinned key the tiers above do not hold."""
        changed = False
        for spec in self._specs:
            epoch = getattr(spec.tier, "loss_epoch", None)
            if isinstance(epoch, int) and self._loss_epochs.get(spec.tier.name, 0) != epoch:
                self._loss_epochs[spec.tier.name] = epoch
                changed = True
        if changed:
            self.forget(self.keys())
