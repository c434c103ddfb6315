from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Chunk(_message.Message):
    __slots__ = ("key", "data", "last", "total_size", "in_arena", "arena_offset", "parent_key", "token_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    IN_ARENA_FIELD_NUMBER: _ClassVar[int]
    ARENA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    data: bytes
    last: bool
    total_size: int
    in_arena: bool
    arena_offset: int
    parent_key: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[bytes] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., total_size: _Optional[int] = ..., in_arena: _Optional[bool] = ..., arena_offset: _Optional[int] = ..., parent_key: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SharedArena(_message.Message):
    __slots__ = ("name", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: bytes
    def __init__(self, name: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("namespace", "pin", "chunk")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    pin: bool
    chunk: Chunk
    def __init__(self, namespace: _Optional[str] = ..., pin: _Optional[bool] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("received", "stored")
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    received: int
    stored: int
    def __init__(self, received: _Optional[int] = ..., stored: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("namespace", "keys", "fingerprint", "tokens", "arena", "max_chunk_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    fingerprint: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    arena: SharedArena
    max_chunk_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., fingerprint: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., arena: _Optional[_Union[SharedArena, _Mapping]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("index", "chunk", "miss")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MISS_FIELD_NUMBER: _ClassVar[int]
    index: int
    chunk: Chunk
    miss: bool
    def __init__(self, index: _Optional[int] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., miss: _Optional[bool] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ContainsResponse(_message.Message):
    __slots__ = ("present", "prefix")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    prefix: int
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., prefix: _Optional[int] = ...) -> None: ...

class LookupPrefixRequest(_message.Message):
    __slots__ = ("namespace", "keys", "model", "tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    model: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., model: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupPrefixResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: int
    def __init__(self, found: _Optional[int] = ...) -> None: ...

class CountResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json", "degraded")
    JSON_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    json: str
    degraded: bool
    def __init__(self, json: _Optional[str] = ..., degraded: _Optional[bool] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class SubscribeEventsRequest(_message.Message):
    __slots__ = ("namespace", "from_seq")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    from_seq: int
    def __init__(self, namespace: _Optional[str] = ..., from_seq: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "model", "codec", "nbytes")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: str
    model: str
    codec: str
    nbytes: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ..., model: _Optional[str] = ..., codec: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium", "reason")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    reason: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ("medium",)
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    medium: str
    def __init__(self, medium: _Optional[str] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("seq", "ts", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts: float
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, seq: _Optional[int] = ..., ts: _Optional[float] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class EventsLost(_message.Message):
    __slots__ = ("from_seq", "to_seq", "reason")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    TO_SEQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    to_seq: int
    reason: str
    def __init__(self, from_seq: _Optional[int] = ..., to_seq: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SubscriptionStarted(_message.Message):
    __slots__ = ("namespace", "next_seq", "oldest_seq")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    OLDEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    next_seq: int
    oldest_seq: int
    def __init__(self, namespace: _Optional[str] = ..., next_seq: _Optional[int] = ..., oldest_seq: _Optional[int] = ...) -> None: ...

class SubscribeEventsResponse(_message.Message):
    __slots__ = ("events", "next_seq", "started", "lost")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    next_seq: int
    started: SubscriptionStarted
    lost: EventsLost
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., next_seq: _Optional[int] = ..., started: _Optional[_Union[SubscriptionStarted, _Mapping]] = ..., lost: _Optional[_Union[EventsLost, _Mapping]] = ...) -> None: ...

class DataPathRequest(_message.Message):
    __slots__ = ("namespace", "op", "keys", "sizes", "pin", "fingerprint", "tokens")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OP_UNSPECIFIED: _ClassVar[DataPathRequest.Op]
        GET: _ClassVar[DataPathRequest.Op]
        PUT: _ClassVar[DataPathRequest.Op]
    OP_UNSPECIFIED: DataPathRequest.Op
    GET: DataPathRequest.Op
    PUT: DataPathRequest.Op
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    op: DataPathRequest.Op
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    pin: bool
    fingerprint: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., op: _Optional[_Union[DataPathRequest.Op, str]] = ..., keys: _Optional[_Iterable[bytes]] = ..., sizes: _Optional[_Iterable[int]] = ..., pin: _Optional[bool] = ..., fingerprint: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DataPathTicket(_message.Message):
    __slots__ = ("ticket", "port", "tls", "expires_s")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_S_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    port: int
    tls: bool
    expires_s: float
    def __init__(self, ticket: _Optional[bytes] = ..., port: _Optional[int] = ..., tls: _Optional[bool] = ..., expires_s: _Optional[float] = ...) -> None: ...

class DataPathResult(_message.Message):
    __slots__ = ("received", "stored", "found")
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    received: int
    stored: int
    found: int
    def __init__(self, received: _Optional[int] = ..., stored: _Optional[int] = ..., found: _Optional[int] = ...) -> None: ...

class DataPathResponse(_message.Message):
    __slots__ = ("ticket", "result")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ticket: DataPathTicket
    result: DataPathResult
    def __init__(self, ticket: _Optional[_Union[DataPathTicket, _Mapping]] = ..., result: _Optional[_Union[DataPathResult, _Mapping]] = ...) -> None: ...
