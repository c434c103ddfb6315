"""How a kvshelf call ends: the status code and message of every failure, and whether it was the client's fault.

``fail`` ends the current call with a code and message from anywhere in a handler; ``status_of`` maps every other
exception to a status (nothing a client or stored data causes is INTERNAL; a call its client cancelled ends
quietly); ``client_fault`` tells which failures are strikes against the caller's tenant (``service/strikes.py``).
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from kvshelf.kvstore.errors import (
    BlockTooLargeError,
    CorruptBlockError,
    ForeignBlockError,
    KVShelfError,
    StoreFullError,
    TierUnavailableError,
)
from kvshelf.service.errors import DataPathError, StreamRefusedError
from kvshelf.service.fairness import RETRY_AFTER_METADATA, RETRY_AFTER_MS

log = logging.getLogger("kvshelf.service.server")


class _Abort(Exception):
    """Ends the current call with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def fail(code: grpc.StatusCode, message: str) -> NoReturn:
    raise _Abort(code, message)


def abort_call(context: grpc.ServicerContext, exc: Exception) -> NoReturn:
    """End the call with ``exc``'s status. A stream refused for want of a slot carries the
    ``RETRY_AFTER_METADATA`` trailer, so clients (``RemoteStore``) know to retry it after a short backoff."""
    if isinstance(exc, StreamRefusedError) and exc.retry:
        context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(RETRY_AFTER_MS)),))
    context.abort(*status_of(exc))
    raise AssertionError("unreachable: abort raises")


CLIENT_FAULT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 grpc.StatusCode.DATA_LOSS, grpc.StatusCode.PERMISSION_DENIED})


def client_fault(exc: Exception) -> bool:
    """Whether a call failed through its client's fault (a strike against its tenant: ``service/strikes.py``)."""
    if isinstance(exc, _Abort):
        return exc.code in CLIENT_FAULT_CODES
    if isinstance(exc, DataPathError):  # a data connection that was refused, stalled or broke its framing
        return exc.code in CLIENT_FAULT_CODES or exc.code in (grpc.StatusCode.UNAUTHENTICATED,
                                                              grpc.StatusCode.DEADLINE_EXCEEDED)
    return isinstance(exc, CorruptBlockError | BlockTooLargeError | ForeignBlockError)


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, _Abort):
        return exc.code, exc.message
    if isinstance(exc, grpc.RpcError):  # the call was cancelled (by its client, or ended by the stream watchdog)
        log.debug("call ended while the server read it: %r", exc)
        return grpc.StatusCode.CANCELLED, "the call was cancelled"
    if isinstance(exc, StreamRefusedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, DataPathError):
        return exc.code, exc.message
    if isinstance(exc, TierUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, f"store unavailable: {exc}"
    if isinstance(exc, StoreFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"store full: {exc}"
    if isinstance(exc, BlockTooLargeError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, CorruptBlockError):
        return grpc.StatusCode.DATA_LOSS, f"damaged block: {exc}"
    if isinstance(exc, MemoryError):
        log.error("out of memory in a kvshelf call")
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "the server is out of memory for this call; retry smaller"
    if isinstance(exc, KVShelfError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.exception("unexpected error in a kvshelf call")
    return grpc.StatusCode.INTERNAL, f"internal server error: {type(exc).__name__}"
