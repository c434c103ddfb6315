from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Chunk(_message.Message):
    __slots__ = ("key", "data", "last", "total_size", "in_arena", "arena_offset")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    IN_ARENA_FIELD_NUMBER: _ClassVar[int]
    ARENA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    data: bytes
    last: bool
    total_size: int
    in_arena: bool
    arena_offset: int
    def __init__(self, key: _Optional[bytes] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., total_size: _Optional[int] = ..., in_arena: _Optional[bool] = ..., arena_offset: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("namespace", "keys", "fingerprint", "tokens", "arena")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    fingerprint: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    arena: SharedArena
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., fingerprint: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., arena: _Optional[_Union[SharedArena, _Mapping]] = ...) -> None: ...

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
