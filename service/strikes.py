"""Per-tenant strikes: a tenant whose calls keep failing through its own fault is refused at admission for a while.

Each call of a tenant that ends with a client-caused error (a bomb, an oversized or over-quota put, a damaged or
malformed value, a stream the watchdog ended as idle or too slow) adds one strike to the tenant's leaky bucket,
which drains at ``leak_per_s``. While the bucket holds ``burst`` strikes or more, the tenant's new streams are
refused at admission (cheap: no message is read) until it has drained below that. An honest client that fails
now and then never fills it; an abusive one is held to about ``leak_per_s`` failing calls per second, so the bytes
and CPU it can make the server spend are bounded whatever it sends (the token-bucket policer of network QoS,
RFC 2697, applied to failures).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class TenantStrikes:
    """Leaky buckets of failed calls, one per tenant (namespace)."""

    burst: float = 20.0  # strikes at which a tenant's new streams are refused
    leak_per_s: float = 5.0  # strikes forgiven per second
    _levels: dict[str, tuple[float, float]] = field(default_factory=dict)  # namespace -> (strikes, at monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _level(self, namespace: str, now: float) -> float:
        strikes, at = self._levels.get(namespace, (0.0, now))
        return max(0.0, strikes - (now - at) * self.leak_per_s)

    def strike(self, namespace: str, now: float | None = None) -> None:
        """Count one failed call of ``namespace``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._levels[namespace] = (self._level(namespace, now) + 1.0, now)
            if len(self._levels) > 4096:  # forget the tenants that have drained
                self._levels = {ns: v for ns, v in self._levels.items() if self._level(ns, now) > 0}

    def blocked_for(self, namespace: str, now: float | None = None) -> float:
        """Seconds until ``namespace`` may open streams again (0.0: it may now)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            excess = self._level(namespace, now) - (self.burst - 1.0)
        return max(0.0, excess / self.leak_per_s)
