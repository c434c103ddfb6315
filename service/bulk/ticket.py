"""One-time tickets of the bulk data path: what a data connection presents to prove it belongs to a control call.

A ticket is issued over the authenticated ``OpenDataPath`` call and names what that call may move::

    version (1) | op (1) | nonce (16) | expires_ms (8, Unix ms, LE) | scope tag of the namespace (8)
    | keys digest (16) | HMAC-SHA256 of all the above under the server's secret (32)        = 82 bytes

The secret is random per server start (tickets never outlive the process that issued them). ``verify`` checks the
signature first (constant time), then the expiry; ``ReplayGuard`` remembers every used nonce until it expires, so a
ticket serves one data connection only. Every refusal is a ``TicketError`` (UNAUTHENTICATED) naming why.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvshelf.kvstore.keys import SCOPE_BYTES, scope_tag
from kvshelf.service.errors import TicketError

TICKET_VERSION = 1
NONCE_BYTES = 16
DIGEST_BYTES = 16
MAC_BYTES = 32
_BODY = struct.Struct(f"<BB{NONCE_BYTES}sQ{SCOPE_BYTES}s{DIGEST_BYTES}s")
TICKET_BYTES = _BODY.size + MAC_BYTES
OP_GET, OP_PUT = 1, 2  # = DataPathRequest.Op
OP_NAMES = {OP_GET: "GET", OP_PUT: "PUT"}


def keys_digest(keys: Sequence[bytes]) -> bytes:
    """BLAKE2b-128 of the count and the keys, in order: what a ticket binds a transfer's keys by."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"kvshelf-ticket1")
    h.update(struct.pack("<I", len(keys)))
    for key in keys:
        h.update(struct.pack("<B", len(key)))
        h.update(key)
    return h.digest()


@dataclass(frozen=True)
class TicketClaims:
    """What a verified ticket says."""

    op: int
    nonce: bytes
    expires_ms: int
    tag: bytes  # the namespace's scope tag (kvstore.keys.scope_tag)
    digest: bytes  # keys_digest of the transfer's keys

    def for_namespace(self, namespace: str) -> bool:
        return hmac.compare_digest(self.tag, scope_tag(namespace))


class TicketSigner:
    """Issues and verifies the tickets of one server (a random secret per instance)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or secrets.token_bytes(32)

    def issue(self, op: int, namespace: str, keys: Sequence[bytes], ttl_s: float,
              now: float | None = None) -> tuple[bytes, TicketClaims]:
        """A signed ticket for ``op`` on ``keys`` of ``namespace``, valid ``ttl_s`` seconds; and its claims."""
        if op not in OP_NAMES:
            raise TicketError(f"no such data-path op {op}")
        now = time.time() if now is None else now
        claims = TicketClaims(op, secrets.token_bytes(NONCE_BYTES), int((now + ttl_s) * 1000), scope_tag(namespace),
                              keys_digest(keys))
        body = _BODY.pack(TICKET_VERSION, op, claims.nonce, claims.expires_ms, claims.tag, claims.digest)
        return body + self._mac(body), claims

    def verify(self, ticket: bytes, now: float | None = None) -> TicketClaims:
        """The claims of ``ticket`` if this signer issued it and it has not expired; else ``TicketError``."""
        if len(ticket) != TICKET_BYTES:
            raise TicketError(f"malformed ticket: {len(ticket)} bytes, tickets are {TICKET_BYTES}")
        body, mac = ticket[: _BODY.size], ticket[_BODY.size :]
        if not hmac.compare_digest(mac, self._mac(body)):
            raise TicketError("forged ticket: its signature does not match (not issued by this server)")
        version, op, nonce, expires_ms, tag, digest = _BODY.unpack(body)
        if version != TICKET_VERSION or op not in OP_NAMES:  # signed, so only a future version of ours
            raise TicketError(f"ticket of version {version}, op {op}: not understood here")
        now = time.time() if now is None else now
        late_s = now - expires_ms / 1000
        if late_s > 0:
            raise TicketError(f"expired ticket: it expired {late_s:.1f} s ago; ask for a new one")
        return TicketClaims(op, nonce, expires_ms, tag, digest)

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._secret, body, hashlib.sha256).digest()


class ReplayGuard:
    """The nonces of used tickets, each kept until its ticket expires: ``use`` admits a nonce once."""

    def __init__(self) -> None:
        self._used: set[bytes] = set()
        self._order: deque[tuple[int, bytes]] = deque()  # (expires_ms, nonce) in the order they were used
        self._lock = threading.Lock()

    def use(self, claims: TicketClaims, now: float | None = None) -> None:
        """Mark the ticket of ``claims`` used; ``TicketError`` when it already was (a replay)."""
        now_ms = int((time.time() if now is None else now) * 1000)
        with self._lock:
            if claims.nonce in self._used:
                raise TicketError("replayed ticket: it was already used (tickets serve one data connection)")
            while self._order and self._order[0][0] < now_ms:  # expired tickets are refused as such: forget them
                self._used.discard(self._order.popleft()[1])
            self._used.add(claims.nonce)
            self._order.append((claims.expires_ms, claims.nonce))

    def __len__(self) -> int:
        with self._lock:
            return len(self._used)
