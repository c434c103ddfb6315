"""Reaching Redis: the client a URL names, the errors that mean "unreachable", the circuit breaker, and
``_run`` / pipelines, through which every command of the tier goes.

The client connects lazily; every command is bounded by ``socket_timeout``; a connection error or timeout raises
``TierUnavailableError`` and opens the breaker (1 s, doubling up to 30 s), during which calls fail at once.
See docs/storage.md ("Redis tier", Availability).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.cluster
import redis.exceptions as rex
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from kvshelf.kvstore.errors import ConfigError, TierUnavailableError

log = logging.getLogger(__package__)
T = TypeVar("T")

Client = redis.Redis | redis.cluster.RedisCluster

#: the circuit breaker's backoff after a failure: first, and the most it doubles to
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0

#: what "Redis cannot be reached now" looks like from redis-py (connection, timeout, cluster down/unroutable)
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.ClusterError,
    rex.ClusterDownError,
    rex.RedisClusterException,
    rex.TryAgainError,
    rex.ReadOnlyError,
    OSError,
)


def _is_data_error(reply: object) -> bool:
    """Whether ``reply`` is an error Redis gave because of what a key holds (not because it is down or refusing):
    a key of the wrong type, a counter that is not an integer or would overflow."""
    if not isinstance(reply, rex.ResponseError) or isinstance(reply, _UNAVAILABLE):
        return False
    text = str(reply)
    return text.startswith("WRONGTYPE") or "not an integer" in text or "overflow" in text


def _readable(reply: T) -> T:
    """A pipeline reply (``raise_on_error=False``) as data: data errors are returned for the caller to treat as
    damage; any other error (unreachable, refused) is raised."""
    if isinstance(reply, BaseException) and not _is_data_error(reply):
        raise reply
    return reply


def _fail_fast(call: Callable[..., T]) -> Callable[..., T]:
    """``call``, raising at once the first connection error or timeout it raised, once it has raised one."""
    failed: list[BaseException] = []

    def wrapper(*args: Any, **kwargs: Any) -> T:
        if failed:
            raise rex.TimeoutError(f"not sent: an earlier command of this call failed ({failed[0]})")
        try:
            return call(*args, **kwargs)
        except (rex.ConnectionError, rex.TimeoutError) as exc:
            failed.append(exc)
            raise

    return wrapper


class _Breaker:
    """Closed (calls go through) until a call finds Redis unreachable; then open for a backoff (doubling from
    ``first_s`` to ``max_s`` with each failure in a row), during which calls are refused at once. After the
    backoff one call (the trial) goes through; its success closes the breaker, its failure opens it again."""

    def __init__(self, name: str, first_s: float = BACKOFF_FIRST_S, max_s: float = BACKOFF_MAX_S) -> None:
        self.name = name
        self.first_s, self.max_s = first_s, max_s
        self._lock = threading.Lock()
        self._backoff = 0.0  # 0: closed
        self._until = 0.0
        self._trial = False
        self._reason = ""

    def admit(self, *, probe: bool = False) -> str | None:
        """``None`` if a call may go ahead now, else why not."""
        with self._lock:
            if not self._backoff or probe:
                return None
            left = self._until - time.monotonic()
            if left > 0:
                return f"down for another {left:.1f} s after {self._reason}"
            if self._trial:
                return f"down (a retry is in flight) after {self._reason}"
            self._trial = True
            return None

    def succeeded(self) -> None:
        with self._lock:
            was_down = bool(self._backoff)
            self._backoff, self._trial = 0.0, False
        if was_down:
            log.warning("Redis tier %s is reachable again", self.name)

    def failed(self, reason: str) -> None:
        with self._lock:
            was_down = bool(self._backoff)
            self._backoff = min(max(2 * self._backoff, self.first_s), self.max_s)
            self._until = time.monotonic() + self._backoff
            self._trial = False
            self._reason = reason
            backoff = self._backoff
        if not was_down:
            log.warning("Redis tier %s is unreachable (%s): calls fail at once for %.1f s, then retry",
                        self.name, reason, backoff)

    def abandon(self) -> None:
        """A trial that ended without telling whether Redis is reachable."""
        with self._lock:
            self._trial = False

    @property
    def is_open(self) -> bool:
        with self._lock:
            return bool(self._backoff)


#: the query parameters of a ``rediss://`` URL, passed to redis-py's TLS connection (file paths as they are)
TLS_PARAMETERS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


def _tls_options(url: str, query: str, tls: bool) -> dict[str, Any]:
    """redis-py's TLS keywords from the query of ``url``; any other parameter (or one on a plain ``redis://``
    URL) is a ``ConfigError``, never silently dropped."""
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in TLS_PARAMETERS:
            raise ConfigError(f"unknown parameter {name!r} in Redis URL {url!r}; accepted: {', '.join(TLS_PARAMETERS)}")
        if not tls:
            raise ConfigError(f"{name} in {url!r} needs TLS: use rediss:// (or rediss+cluster://)")
        if name in options:
            raise ConfigError(f"parameter {name!r} given twice in Redis URL {url!r}")
        if name == "ssl_cert_reqs":
            if value.lower() not in ("none", "optional", "required"):
                raise ConfigError(f"ssl_cert_reqs must be none, optional or required, got {value!r} in {url!r}")
            options[name] = value.lower()
        elif name == "ssl_check_hostname":
            if value.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ConfigError(f"ssl_check_hostname must be true or false, got {value!r} in {url!r}")
            options[name] = value.lower() in ("1", "true", "yes", "on")
        else:
            options[name] = value
    return options


def connector(url: str, socket_timeout: float) -> tuple[Callable[[], Client], str]:
    """The client factory of ``redis://[:password@]host:port/db`` (standalone) or ``redis+cluster://host:port`` (a
    seed node of a Redis Cluster), or of ``rediss://`` / ``rediss+cluster://`` (TLS; the query may carry
    ``TLS_PARAMETERS``, e.g. ``?ssl_ca_certs=/path/ca.pem``), and where it points (for messages). Nothing is
    connected here."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        raise ConfigError(
            f"unknown Redis URL scheme {parts.scheme!r} in {url!r}: use redis://host:port/db "
            "or redis+cluster://host:port"
        )
    try:
        host, port = parts.hostname or "localhost", parts.port or 6379
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL {url!r}: {exc}") from exc
    options: dict[str, Any] = {
        "host": host,
        "port": port,
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else None,
        "ssl": scheme.startswith("rediss"),
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_timeout,
        "decode_responses": False,
        **_tls_options(url, parts.query, scheme.startswith("rediss")),
    }
    # a few quick retries of a dropped connection (milliseconds), never of a timeout: a hung server must cost
    # a call one timeout, not three
    backoff = ExponentialWithJitterBackoff(base=0.01, cap=0.1)
    where = f"{scheme}://{host}:{port}"
    if scheme.endswith("+cluster"):
        if parts.path.strip("/") not in ("", "0"):
            raise ConfigError(f"Redis Cluster has only database 0, got {url!r}")

        def connect() -> Client:
            # no cluster-level retry (each would cost a frozen node another timeout): a failed call opens the
            # breaker, and the call after the backoff finds the refreshed slot map (MOVED/ASK are still followed)
            return redis.cluster.RedisCluster(retry=Retry(backoff, retries=0), **options)

    else:
        db_text = parts.path.strip("/") or "0"
        if not db_text.isdigit():
            raise ConfigError(f"bad Redis database number {db_text!r} in {url!r}")
        where += f"/{db_text}"

        def connect() -> Client:
            retry = Retry(backoff, retries=2, supported_errors=(rex.ConnectionError,))
            return redis.Redis(db=int(db_text), health_check_interval=30, retry=retry, **options)

    return connect, where


class Connection:
    """``RedisTier``'s way to Redis (a mixin): the lazily made client, the breaker, pipelines."""

    name: str
    where: str
    _connect: Callable[[], Client]
    _client: Client | None
    _lock: threading.Lock
    _breaker: _Breaker

    def _unavailable(self, what: str, reason: str) -> TierUnavailableError:
        return TierUnavailableError(f"Redis tier {self.name!r} at {self.where} is unavailable ({what}): {reason}")

    def _run(self, what: str, fn: Callable[[Client], T], *, probe: bool = False) -> T:
        """``fn(client)`` through the circuit breaker, with every "cannot reach Redis" error turned into
        ``TierUnavailableError`` (and opening the breaker), and any other error Redis answers with (refused, no
        permission...) into ``TierUnavailableError`` too."""
        refused = self._breaker.admit(probe=probe)
        if refused is not None:
            raise self._unavailable(what, refused)
        try:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
                client = self._client
            result = fn(client)
        except _UNAVAILABLE as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self._breaker.failed(reason)
            raise self._unavailable(what, reason) from exc
        except rex.RedisError as exc:  # Redis answered, with an error no data of ours explains
            self._breaker.succeeded()
            raise self._unavailable(what, f"Redis refused: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            self._breaker.abandon()
            raise
        self._breaker.succeeded()
        return result

    @staticmethod
    def _pipeline(client: Client) -> Any:
        pipe = client.pipeline(transaction=False)
        resend = getattr(pipe, "parent_execute_command", None)
        if isinstance(client, redis.cluster.RedisCluster) and resend is not None:
            # redis-py's cluster pipeline resends each command that failed with a connection error or timeout
            # one by one: against a hung node, one timeout per command. After the first, fail the rest at once.
            pipe.parent_execute_command = _fail_fast(resend)
        return pipe

    def _execute(self, client: Client, commands: Iterable[Callable[[Any], Any]], batch: int = 4096) -> list[Any]:
        """Run ``commands`` (each queues one command on a pipeline) in pipelines of at most ``batch``; the
        replies, errors included."""
        out: list[Any] = []
        pipe, queued = self._pipeline(client), 0
        for command in commands:
            command(pipe)
            queued += 1
            if queued == batch:
                out.extend(pipe.execute(raise_on_error=False))
                pipe, queued = self._pipeline(client), 0
        if queued:
            out.extend(pipe.execute(raise_on_error=False))
        return out
