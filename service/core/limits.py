"""``ServerLimits``: the size limits, quotas and fairness settings of one server (``kvshelf serve`` fills them from
its settings, ``ServeConfig.server_limits``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvshelf.kvstore.errors import ConfigError

MAX_KEYS_PER_CALL = 100_000


@dataclass(frozen=True)
class ServerLimits:
    """Size limits and quotas of one server."""

    max_block_bytes: int = 256 << 20  # one encoded value, and what one may decode to (server or client)
    max_call_bytes: int = 1 << 30  # one PutBlocks call (held until it ends); also one tenant's puts in flight together
    quota_bytes: int | None = None  # per namespace, in each tier (overwrites count what they add); None: unlimited
    shared_memory: bool = True  # same-host GetBlocks through client arenas in /dev/shm (service/arena.py)
    tenant_streams: int = 8  # streaming calls one tenant may have open at once
    idle_timeout_s: float = 10.0  # a stream making no progress this long is cancelled
    min_rate_bytes: int = 1 << 20  # slowest accepted upload (bytes/s), checked once a put is idle_timeout_s old
    max_inflight_bytes: int | None = None  # put bytes buffered at once, all tenants; None: 2 x max_call_bytes
    strike_burst: int = 20  # failed calls (client's fault) at which a tenant's streams are refused; 0: never
    strike_leak_per_s: float = 5.0  # failed calls per second a tenant is forgiven (service/strikes.py)
    max_subscriptions: int = 8  # SubscribeEvents streams open at once, all tenants (extra worker threads)
    tenant_subscriptions: int = 2  # SubscribeEvents streams one tenant may have open at once
    subscriber_queue: int = 10_000  # events waiting for one subscriber before it is cut off as too slow
    events_log_bytes: int = 64 << 20  # the persistent event log's bound (replay reaches back this far)
    data_path: bool = True  # the bulk data path beside gRPC (service/bulk/): values over a raw TCP (or TLS) port
    data_port: int = 0  # its port on the listen host (0: any free one; clients learn it from each ticket)
    data_handshakes: int = 64  # data connections in their handshake at once (half that from one peer host)

    @property
    def inflight_bytes(self) -> int:
        """Put bytes buffered at once, all tenants together (``max_inflight_bytes``, else 2 x ``max_call_bytes``)."""
        return self.max_inflight_bytes or 2 * self.max_call_bytes

    def __post_init__(self) -> None:
        if self.max_block_bytes <= 0 or self.max_call_bytes <= 0:
            raise ConfigError("max block and call sizes must be > 0")
        if self.quota_bytes is not None and self.quota_bytes <= 0:
            raise ConfigError(f"the namespace quota must be > 0 bytes, got {self.quota_bytes}")
        if not 0 <= self.data_port < 65536 or self.data_handshakes < 1:
            raise ConfigError(f"data_port must be in [0, 65535] and data_handshakes >= 1, got {self.data_port}, "
                              f"{self.data_handshakes}")
        if self.strike_burst < 0 or self.strike_leak_per_s <= 0:
            raise ConfigError(f"strike_burst must be >= 0 and strike_leak_per_s > 0, got {self.strike_burst}, "
                              f"{self.strike_leak_per_s}")
