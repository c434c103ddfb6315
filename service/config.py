"""The configuration of ``kvshelf serve``: one nested, parsed dataclass, the single source of every setting.

``ServeConfig`` has one section per concern (``server``, ``store``, ``limits``, ``fairness``, ``events``,
``kv_events``, ``auth``, ``metrics``, ``admin``); each field carries its metadata (``setting``): its key (the TOML
key and the base of the flag and of the environment variable), its help text and how its text is read. From it come:

* the flags of ``kvshelf serve`` (``kvshelf/cli/serve.py`` builds its options from ``SETTINGS``);
* the ``KVSHELF_<KEY>`` environment variables and the TOML keys (``load_config``);
* the settings tables of docs/configuration.md (``docs/gen_config.py``, one table per section).

Sources, strongest first: flags > ``KVSHELF_*`` environment > TOML file (``--config`` or ``$KVSHELF_CONFIG``;
keys at the top level, under ``[serve]``, or under ``[serve.SECTION]``) > defaults. Sizes (``"512MiB"``) are
parsed once, here: the sections hold integers (bytes). The limits, fairness and events sections use the field
names of ``service.server.ServerLimits``, which ``ServeConfig.server_limits`` fills from them.

Light on purpose: the standard library only at module level (the command line builds ``kvshelf serve --help``
from it without loading the store, grpc or torch); the store's parsing and errors are imported when used.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "KVSHELF_"
#: ``--durability``: what an acknowledged put survives. ``fsync``: anything (power cut included): each put's commit is
#: flushed to the disk before the put returns. ``interval``: a crash or SIGKILL of the server (the commit is in the
#: operating system before the put returns); the disk is flushed every ``--sync-interval`` seconds, so an OS crash
#: or power cut loses at most that many seconds of puts (lost blocks are misses; the file is checked at open).
DURABILITY = ("fsync", "interval")
MIN_DISK_BYTES = 1 << 20  # = kvstore.embedded.MIN_DISK_BYTES (tests/service/test_config.py checks)
DEFAULT_POLICY = "prefix"  # = kvstore.eviction.DEFAULT_POLICY (tests/service/test_config.py checks)
#: the URL schemes ``--redis`` accepts (the shared tiers of kvstore.tier_registry)
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")


def _error(message: str) -> Exception:
    from kvshelf.kvstore.errors import ConfigError

    return ConfigError(message)


# -- field metadata ------------------------------------------------------------------------------------------------


def setting(default: Any, help: str, *, kind: str, key: str = "", minimum: float | None = None,
            above: float | None = None, unset: bool = False, choices: tuple[str, ...] = (),
            negatable: bool = True, check: Callable[[Any], None] | None = None, shown: str = "") -> Any:
    """A field of a section with its metadata.

    ``kind``: ``str``, ``int``, ``float``, ``bool`` or ``size`` (bytes; text like ``"512MiB"``); ``key``: the
    setting's name (default: the field's); ``minimum``/``above``: the least value (inclusive/exclusive);
    ``unset``: ``""`` (None) is allowed; ``choices``: the values accepted; ``negatable``: a bool flag has a
    ``--no-`` form; ``check``: raises ``ConfigError`` for a bad value; ``shown``: the default as the help shows it.
    """
    meta = dict(help=help, kind=kind, key=key, minimum=minimum, above=above, unset=unset, choices=choices,
                negatable=negatable, check=check, shown=shown)
    return field(default=default, metadata={"setting": meta})


def size(default: int | None, help: str, *, minimum: int = 1, **kwargs: Any) -> Any:
    return setting(default, help, kind="size", minimum=minimum, **kwargs)


def _check_policy(name: str) -> None:
    from kvshelf.kvstore.eviction import make_policy

    make_policy(name, 1)  # an unknown name: ConfigError listing the known ones


def _check_redis_url(url: str) -> None:
    from kvshelf.kvstore.tier_registry import TierURL

    if url.split("://", 1)[0].lower() not in REDIS_SCHEMES or "://" not in url:
        raise _error(f"{url!r} is not a Redis URL; use one of {', '.join(s + '://' for s in REDIS_SCHEMES)}")
    parsed = TierURL.parse(url)
    if not parsed.location.split("/", 1)[0].rsplit("@", 1)[-1]:
        raise parsed.error("a Redis URL needs a host (redis://HOST:PORT/DB)")


def _check_listen(address: str) -> None:
    from kvshelf.service.address import check_listen

    check_listen(address, "")


def _check_host(host: str) -> None:
    from kvshelf.service.address import check_host

    check_host(host, "")


# -- the sections --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSection:
    """Listening, threads and the server's lifecycle."""

    listen: str = setting("127.0.0.1:50051", "HOST:PORT to listen on, IPv6 in brackets (port 0: any free port, "
                          "printed on the start-up line)", kind="str", check=_check_listen)
    workers: int = setting(32, "gRPC worker threads; streams never take the last quarter of them", kind="int",
                           minimum=1)
    grace: float = setting(10.0, "seconds to drain in-flight calls on SIGTERM", kind="float", minimum=0)
    shared_memory: bool = setting(True, "same-host gets through client arenas in /dev/shm (loopback/Unix "
                                  "peers only)", kind="bool")
    data_path: bool = setting(True, "the bulk data path: values of gets and puts over a raw TCP (TLS with "
                              "tls_cert) connection per call beside gRPC, by one-time tickets", kind="bool")
    data_port: int = setting(0, "port of the data path on the listen host (0: any free one; clients learn it from "
                             "each ticket)", kind="int", minimum=0)
    arena_sweep_interval: float = setting(30.0, "seconds between sweeps of dead clients' /dev/shm arenas "
                                          "(shared_memory)", kind="float", above=0)
    history_interval: float = setting(10.0, "seconds between the stats-history samples `kvshelf stats --plot` "
                                      "draws", kind="float", above=0)


@dataclass(frozen=True)
class StoreSection:
    """The tiers: CPU memory, LMDB under the data directory, and the shared Redis tier."""

    data_dir: str = setting("", "store directory (memory tier over LMDB, and the event log); unset: "
                            "$KVSHELF_DATA_DIR, else $KVSHELF_CACHE/store (~/.cache/kvshelf/store)", kind="str")
    memory_bytes: int = size(2 << 30, "memory tier capacity, e.g. 2GiB; 0: no memory tier", key="memory",
                             minimum=0)
    max_disk_bytes: int = size(1 << 40, "LMDB tier capacity: it evicts to stay under it; the file may pass it by "
                               "a slack for LMDB's own pages (39.25MiB for 256MiB, ~2.7% for 1TiB)",
                               key="max_disk", minimum=MIN_DISK_BYTES)
    disk_codec: str = setting("", "codec the LMDB (and Redis) tier re-encodes blocks into; unset: every tier keeps "
                              "blocks in the codec clients sent them in (clients decode)", kind="str")
    eviction_policy: str = setting(DEFAULT_POLICY, "what the memory and LMDB tiers evict: prefix, arc, s3fifo or "
                                   "lru (compare them with `kvshelf replay`)", kind="str", check=_check_policy)
    redis: str = setting("", "URL of the shared tier: redis://HOST:PORT/DB, rediss:// (TLS), "
                         "redis+cluster://HOST:PORT or rediss+cluster:// (kvstore.tier_registry)", kind="str",
                         check=_check_redis_url)
    redis_timeout: float = setting(1.0, "seconds one Redis call may take before the tier counts as unreachable",
                                   kind="float", above=0)
    durability: str = setting("fsync", "fsync: each put is flushed to the disk before it is acknowledged; "
                              "interval: committed to the OS before it is acknowledged (a server crash or SIGKILL "
                              "loses nothing), flushed every sync_interval seconds (an OS crash or power cut loses "
                              "at most that)", kind="str", choices=DURABILITY)
    sync_interval: float = setting(1.0, "seconds between flushes to disk with durability interval", kind="float",
                                   above=0)
    reset_disk: bool = setting(False, "a damaged LMDB environment is moved aside (DIR/lmdb.damaged-TIME, "
                               "never deleted) and an empty one started; to keep its readable blocks run "
                               "`kvshelf repair` instead", kind="bool", negatable=False)

    def resolved_data_dir(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir)
        from kvshelf.kvstore.embedded import default_data_dir

        return default_data_dir()


@dataclass(frozen=True)
class LimitsSection:
    """Sizes of blocks, calls and namespaces (``ServerLimits`` fields)."""

    max_block_bytes: int = size(256 << 20, "largest value (and largest decoded size of a block) the server "
                                "accepts", key="max_block")
    max_call_bytes: int = size(1 << 30, "bytes one PutBlocks call may carry (values are held until the call ends)",
                               key="max_call")
    quota_bytes: int | None = size(None, "per-namespace byte quota, e.g. 10GiB; unset: unlimited", key="quota",
                                   unset=True)
    max_inflight_bytes: int | None = size(None, "put bytes buffered at once, all tenants together; unset: "
                                          "2 x max_call", key="max_inflight", unset=True)


@dataclass(frozen=True)
class FairnessSection:
    """What one tenant may take of the server (``ServerLimits`` fields; service/fairness.py, service/strikes.py)."""

    tenant_streams: int = setting(8, "streaming calls (PutBlocks, GetBlocks) one tenant may have open at once",
                                  kind="int", minimum=1)
    idle_timeout_s: float = setting(10.0, "seconds a stream may make no progress before the server cancels it",
                                    kind="float", key="idle_timeout", above=0)
    min_rate_bytes: int = size(1 << 20, "slowest accepted PutBlocks upload, bytes per second (checked after "
                               "idle_timeout)", key="min_rate", minimum=0)
    data_handshakes: int = setting(64, "data-path connections in their handshake or kept for their next transfer at "
                                   "once (half that from one host); more are refused", kind="int", minimum=1)
    strike_burst: int = setting(20, "failed calls (the client's fault) at which a tenant's streams are refused; "
                                "0: never", kind="int", minimum=0)
    strike_leak_per_s: float = setting(5.0, "failed calls per second a tenant is forgiven (service/strikes.py)",
                                       kind="float", key="strike_rate", above=0)


@dataclass(frozen=True)
class EventsSection:
    """The KV event log and its subscribers (``ServerLimits`` fields)."""

    events_log_bytes: int = size(64 << 20, "bound of the KV event log in DATA_DIR/events (how far back a replay "
                                 "reaches)", key="events_log", minimum=4096)
    max_subscriptions: int = setting(8, "SubscribeEvents streams (`kvshelf events`) open at once, all tenants "
                                     "(each has a thread of its own)", kind="int", minimum=1)
    tenant_subscriptions: int = setting(2, "SubscribeEvents streams one tenant may have open at once", kind="int",
                                        minimum=1)
    subscriber_queue: int = setting(10_000, "events waiting for one subscriber before it is cut off as too slow",
                                    kind="int", minimum=1)


def _check_endpoint(setting_key: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if value:
            from kvshelf.kvstore.vllm_events import parse_endpoint

            parse_endpoint(str(value), setting_key)

    return check


@dataclass(frozen=True)
class KVEventsSection:
    """vLLM-format KV events over ZeroMQ for routers (``kvstore/vllm_events.py``; vLLM's ``KVEventsConfig``)."""

    endpoint: str = setting("", "publish vLLM-format KV events here: tcp://*:PORT binds, tcp://HOST:PORT connects; "
                            "unset: off", kind="str", key="kv_events_endpoint",
                            check=_check_endpoint("kv_events_endpoint"))
    replay_endpoint: str = setting("", "ROUTER endpoint (bound) that replays buffered batches from a sequence "
                                   "number; unset: no replay", kind="str", key="kv_events_replay_endpoint",
                                   check=_check_endpoint("kv_events_replay_endpoint"))
    topic: str = setting("", "topic prefix of every batch (the batch's namespace follows it)", kind="str",
                         key="kv_events_topic")
    buffer_steps: int = setting(10_000, "batches kept for replay", kind="int", key="kv_events_buffer_steps",
                                minimum=1)
    buffer_bytes: int = size(64 << 20, "payload bytes kept for replay (beside kv_events_buffer_steps); as much again "
                             "may wait for subscribers that read slowly", key="kv_events_buffer_bytes",
                             minimum=4096)
    hwm: int = setting(100_000, "ZeroMQ high-water mark of the PUB socket (batches per subscriber)", kind="int",
                       key="kv_events_hwm", minimum=1)
    max_queue_size: int = setting(100_000, "events waiting to be published; past it an event is dropped (counted)",
                                  kind="int", key="kv_events_queue", minimum=1)
    block_hashes: str = setting("int", "block hashes as vLLM's int (the key's low 64 bits) or the key's bytes",
                                kind="str", key="kv_events_block_hashes", choices=("int", "bytes"))
    namespaces: str = setting("", "comma-separated namespaces whose events are published; unset: every one",
                              kind="str", key="kv_events_namespaces")

    def settings(self) -> Any:
        """``kvstore.vllm_events.KVEventsSettings`` (None when no endpoint is set)."""
        if not self.endpoint:
            return None
        from kvshelf.kvstore.vllm_events import KVEventsSettings

        names = frozenset(n.strip() for n in self.namespaces.split(",") if n.strip()) or None
        return KVEventsSettings(endpoint=self.endpoint, replay_endpoint=self.replay_endpoint or None,
                                topic=self.topic, buffer_steps=self.buffer_steps, buffer_bytes=self.buffer_bytes,
                                hwm=self.hwm,
                                max_queue_size=self.max_queue_size, block_hashes=self.block_hashes,  # type: ignore
                                namespaces=names)


@dataclass(frozen=True)
class AuthSection:
    """Who may call: bearer tokens and TLS."""

    tokens_file: str = setting("", "TOML [tokens] \"token\" = \"namespace\"; unset: dev mode (namespace from the "
                               "request)", kind="str")
    tls_cert: str = setting("", "PEM certificate: the server speaks TLS (needs tls_key)", kind="str")
    tls_key: str = setting("", "PEM private key of tls_cert", kind="str")


@dataclass(frozen=True)
class MetricsSection:
    """The Prometheus endpoint."""

    port: int = setting(0, "Prometheus /metrics on this port; 0: off", kind="int", key="metrics_port", minimum=0)
    addr: str = setting("127.0.0.1", "address of the /metrics endpoint; any other than 127.0.0.1 needs "
                        "metrics_token_file", kind="str", key="metrics_addr", check=_check_host)
    token_file: str = setting("", "file holding the bearer token /metrics requires; unset: no token", kind="str",
                              key="metrics_token_file")
    namespaces: str = setting("", "comma-separated namespaces /metrics shows; unset: every namespace", kind="str",
                              key="metrics_namespaces")


@dataclass(frozen=True)
class AdminSection:
    """The admin dashboard: a web page of live charts (``service/dashboard.py``)."""

    port: int = setting(0, "admin dashboard (web page) on this port; 0: off", kind="int", key="admin_port",
                        minimum=0)
    addr: str = setting("127.0.0.1", "address of the dashboard; any other than loopback needs admin_token_file",
                        kind="str", key="admin_addr", check=_check_host)
    token_file: str = setting("", "file holding the token the dashboard requires (a bearer header or its login "
                              "form); unset: no token", kind="str", key="admin_token_file")
    namespaces: str = setting("", "comma-separated namespaces the dashboard shows; unset: every namespace",
                              kind="str", key="admin_namespaces")


@dataclass(frozen=True)
class ServeConfig:
    """Every setting of ``kvshelf serve``, parsed (sizes in bytes), one section per concern."""

    server: ServerSection = field(default_factory=ServerSection)
    store: StoreSection = field(default_factory=StoreSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    fairness: FairnessSection = field(default_factory=FairnessSection)
    events: EventsSection = field(default_factory=EventsSection)
    kv_events: KVEventsSection = field(default_factory=KVEventsSection)
    auth: AuthSection = field(default_factory=AuthSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    admin: AdminSection = field(default_factory=AdminSection)

    @classmethod
    def from_settings(cls, **settings: Any) -> ServeConfig:
        """A config from settings by key (``memory="64MiB"``, ``listen=...``), as flags would give them; nothing
        from the environment or a file."""
        return load_config(settings, env={})

    def resolved_data_dir(self) -> Path:
        return self.store.resolved_data_dir()

    def check(self) -> None:
        """``ConfigError`` (named by the flag) for a value out of range or a bad combination."""
        for spec in SETTINGS:
            spec.check_value(spec.get(self), spec.flag)
        if bool(self.auth.tls_cert) != bool(self.auth.tls_key):
            raise _error("TLS needs both --tls-cert and --tls-key")
        if not 0 <= self.server.data_port < 65536:
            raise _error(f"--data-port: data_port must be in [0, 65535], got {self.server.data_port}")
        if not 0 <= self.metrics.port < 65536:
            raise _error(f"--metrics-port: metrics_port must be in [0, 65535], got {self.metrics.port}")
        if not 0 <= self.admin.port < 65536:
            raise _error(f"--admin-port: admin_port must be in [0, 65535], got {self.admin.port}")
        if self.admin.port and self.admin.port == self.metrics.port:
            raise _error(f"--admin-port: {self.admin.port} is also --metrics-port; give each its own port")

    def server_limits(self) -> Any:
        """``service.server.ServerLimits`` from the limits, fairness and events sections (same field names) and
        ``server.shared_memory``, ``server.data_path`` and ``server.data_port``."""
        from kvshelf.service.server import ServerLimits

        values: dict[str, Any] = {"shared_memory": self.server.shared_memory, "data_path": self.server.data_path,
                                  "data_port": self.server.data_port}
        for section in (self.limits, self.fairness, self.events):
            values.update({f.name: getattr(section, f.name) for f in dataclasses.fields(section)})
        return ServerLimits(**values)


#: section name -> its dataclass, in the order of ``ServeConfig``
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(ServeConfig)}  # type: ignore[misc]


# -- the settings, flat --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting: where it lives (``section.name``) and how it is given."""

    section: str
    name: str  # the field's name in its section
    key: str  # TOML key; flag ``--key-with-dashes``; environment ``KVSHELF_KEY``
    kind: str
    default: Any
    help: str
    minimum: float | None
    above: float | None
    unset: bool
    choices: tuple[str, ...]
    negatable: bool
    check: Callable[[Any], None] | None
    shown: str

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    def get(self, config: ServeConfig) -> Any:
        return getattr(getattr(config, self.section), self.name)

    def shown_default(self) -> str:
        """The default as the help and the docs show it (``""`` when unset)."""
        if self.shown:
            return self.shown
        if self.default is None or self.default == "":
            return ""
        if self.kind == "size":
            return format_size(self.default)
        if self.kind == "bool":
            return "true" if self.default else "false"
        return str(self.default)

    def parse(self, value: Any, source: str) -> Any:
        """``value`` (text from a flag or the environment, or a TOML value) as this setting's type; errors start
        with ``source`` (``--flag``, ``$KVSHELF_NAME`` or ``FILE: key``)."""
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise _error(f"{source}: {self.key} must be true or false, got {value!r}")
        if self.kind in ("int", "float"):
            if isinstance(value, bool):
                raise _error(f"{source}: {self.key} must be a number, got {value!r}")
            try:
                number = float(value) if self.kind == "float" else int(value)
            except (TypeError, ValueError):
                raise _error(f"{source}: {self.key} must be a number, got {value!r}") from None
            self.check_value(number, source)
            return number
        if self.kind == "size":
            if self.unset and str(value).strip() == "":
                return None
            from kvshelf.kvstore.sizes import parse_size

            plain = value if isinstance(value, int | float) and not isinstance(value, bool) else str(value)
            number = parse_size(plain, source)
            self.check_value(number, source)
            return number
        self.check_value(str(value), source)
        return str(value)

    def check_value(self, value: Any, source: str) -> None:
        """``ConfigError`` starting with ``source`` when a parsed value is out of this setting's range."""
        if value is None and self.unset:
            return
        if self.kind == "size":
            if isinstance(value, bool) or not isinstance(value, int):
                raise _error(f"{source}: {value!r} is not a whole number of bytes")
            if self.minimum is not None and value < self.minimum:
                raise _error(f"{source}: {value!r} is too small (at least {int(self.minimum)} bytes)")
            return
        if self.kind in ("int", "float"):
            if self.kind == "float" and not math.isfinite(value):
                raise _error(f"{source}: {self.key} must be a finite number, got {value!r}")
            if self.minimum is not None and value < self.minimum:
                raise _error(f"{source}: {self.key} must be >= {self.minimum:g}, got {value!r}")
            if self.above is not None and not value > self.above:
                raise _error(f"{source}: {self.key} must be > {self.above:g} seconds, got {value!r}"
                             if self.kind == "float" else f"{source}: {self.key} must be > {self.above:g}")
        if self.choices and value not in self.choices:
            raise _error(f"{source}: {self.key} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.check is not None and value not in ("", None):
            try:
                self.check(value)
            except Exception as exc:
                if type(exc).__name__ != "ConfigError":
                    raise
                raise _error(f"{source}: {exc}") from None


def _settings() -> Iterator[Setting]:
    for section_name, section in SECTIONS.items():
        for f in dataclasses.fields(section):
            meta = f.metadata["setting"]
            yield Setting(section=section_name, name=f.name, key=meta["key"] or f.name, kind=meta["kind"],
                          default=f.default, help=meta["help"], minimum=meta["minimum"], above=meta["above"],
                          unset=meta["unset"], choices=meta["choices"], negatable=meta["negatable"],
                          check=meta["check"], shown=meta["shown"])


#: every setting, section by section
SETTINGS: tuple[Setting, ...] = tuple(_settings())
#: key -> setting
BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}
assert len(BY_KEY) == len(SETTINGS), "two settings share a key"


def format_size(value: int) -> str:
    """``2147483648`` -> ``"2GiB"`` (the largest binary unit that divides it)."""
    for unit, shift in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value and value % (1 << shift) == 0:
            return f"{value >> shift}{unit}"
    return str(value)


# -- the sources ---------------------------------------------------------------------------------------------------


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Settings by key from a TOML file: at the top level, under ``[serve]``, or in section tables
    (``[serve.store]``, or ``[store]`` at the top level); ``-`` or ``_`` in keys; unknown keys are errors. The
    values are parsed (``"1GiB"`` -> bytes)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise _error(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise _error(f"config file {path} is not valid TOML: {exc}") from exc
    data = data.get("serve", data)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            items = [(key, name, inner) for name, inner in value.items()]
        else:
            items = [("", key, value)]
        for section, name, inner in items:
            spec = BY_KEY.get(name.replace("-", "_"))
            if spec is None or (section and spec.section != section):
                where = f"[{section}] " if section else ""
                known = ", ".join(s.key for s in SETTINGS if not section or s.section == section)
                raise _error(f"config file {path}: unknown setting {where}{name!r}; known: {known}")
            out[spec.key] = spec.parse(inner, f"{path}: {spec.key}")
    return out


def load_config(flags: Mapping[str, Any], env: Mapping[str, str] | None = None,
                config_file: str | Path | None = None) -> ServeConfig:
    """Merge the sources: ``flags`` by key (None values = not given) > ``KVSHELF_<KEY>`` in ``env`` > the TOML file
    (``config_file``, else ``$KVSHELF_CONFIG``) > defaults; each value parsed once, errors naming its source."""
    env = os.environ if env is None else env
    config_file = config_file or env.get(f"{ENV_PREFIX}CONFIG") or None
    merged: dict[str, Any] = read_config_file(config_file) if config_file else {}
    for spec in SETTINGS:
        value = env.get(spec.env)
        if value is not None and value != "":
            merged[spec.key] = spec.parse(value, f"${spec.env}")
    for key, value in flags.items():
        spec = BY_KEY.get(key)
        if spec is None:
            raise _error(f"unknown setting {key!r}; known: {', '.join(BY_KEY)}")
        if value is not None:
            merged[key] = spec.parse(value, spec.flag)
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in merged.items():
        spec = BY_KEY[key]
        sections[spec.section][spec.name] = value
    config = ServeConfig(**{name: SECTIONS[name](**values) for name, values in sections.items()})
    config.check()
    return config
