"""Errors of the service layer (all ``KVShelfError``; re-exported by ``kvshelf``)."""

from __future__ import annotations

import grpc

from kvshelf.kvstore.errors import KVShelfError


class ServiceError(KVShelfError):
    """Base class of the service layer's errors."""


class RemoteStoreError(ServiceError):
    """The server refused a call (``code`` is the ``grpc.StatusCode``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class BearerError(ServiceError):
    """A call's ``authorization`` metadata cannot be read as one bearer token (missing, two headers, another
    scheme, empty): the server answers UNAUTHENTICATED with this message."""


class WireError(ServiceError):
    """Bytes that are not a well-formed message of the hand-read wire format (``service/wire.py``): a
    ``GetBlocksResponse`` or a ``PutBlocksRequest``."""


class WireLimitError(WireError):
    """A ``PutBlocksRequest`` that carries more bytes besides its chunk's data than the caller allows
    (``decode_put_request(max_rest_bytes=...)``), refused before protobuf parses them. ``size`` is the count of
    those bytes, or with ``exact`` False a lower bound (the reader stops as soon as it knows the limit is passed),
    ``limit`` the caller's limit."""

    def __init__(self, size: int, limit: int, *, exact: bool = True) -> None:
        counted = f"{size}" if exact else f"at least {size}"
        super().__init__(f"PutBlocksRequest carries {counted} bytes besides its data, more than the limit of {limit}")
        self.size = size
        self.limit = limit
        self.exact = exact


class ArenaUnavailable(ServiceError, OSError):  # noqa: N818 - a condition the caller falls back from
    """The shared-memory arena cannot be used (missing, not ours, wrong token, no space): fall back to the wire."""


class StreamRefusedError(ServiceError):
    """A streaming call refused at admission (``service/fairness.py``): its tenant is at its cap, or every stream
    slot is taken (``retry``: the client sees RESOURCE_EXHAUSTED with a retry trailer and ``RemoteStore`` retries
    it), or its tenant has too many failed calls (``service/strikes.py``; not retried)."""

    def __init__(self, message: str, *, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry


class DataPathError(ServiceError):
    """The bulk data path (``service/bulk/``) refused a transfer: ``code`` is the ``grpc.StatusCode`` the data
    connection and the control call report (a status frame on the one, the call's status on the other)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class TicketError(DataPathError):
    """A data-path ticket that is not one this server issued and still honours: malformed or forged (bad signature),
    expired, already used (replayed), or for another op (UNAUTHENTICATED)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAUTHENTICATED, message)


class FramingError(DataPathError):
    """Bytes of a data connection that break its framing (``service/bulk/framing.py``): bad magic or version, a
    field over its hard limit, a value whose checksum does not match, more or fewer bytes than announced. DATA_LOSS
    unless ``code`` says otherwise."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.DATA_LOSS) -> None:
        super().__init__(code, message)


class DataPathUnavailable(ServiceError):  # noqa: N818 - a condition the caller falls back from
    """The bulk data path cannot be used for a call (the server has none or has it off; its port cannot be reached;
    the connection was cut before any reply; the data port is busy): ``RemoteStore`` falls back to gRPC, and tries
    the data path again after ``retry_after_s`` seconds (None: never, the server has none)."""

    def __init__(self, message: str, retry_after_s: float | None = 30.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
