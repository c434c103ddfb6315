"""Exception types raised by kvshelf. Every error a user can cause is one of these."""

from __future__ import annotations


class KVShelfError(Exception):
    """Base class of every kvshelf error."""


class ConfigError(KVShelfError, ValueError):
    """A setting is invalid (a capacity of 0, an unknown tier, a bad block size...)."""


class TraceError(ConfigError):
    """A request trace that cannot be read, or a malformed line of one (the message names the file and line)."""


class UnknownCodecError(ConfigError):
    """A codec name that is not registered."""


class CodecParamError(ConfigError):
    """Parameters a codec does not accept, or values out of range."""


class CorruptBlockError(KVShelfError):
    """An encoded block failed validation (bad magic, truncated, checksum mismatch, bad header)."""


class BlockTooLargeError(KVShelfError):
    """A block whose declared shape decodes to more bytes than a configured bound (max block size, a tier's
    capacity): refused before anything is allocated for it."""


class ForeignBlockError(KVShelfError):
    """A well-formed block that belongs to another key, namespace or model fingerprint."""


class StoreFullError(KVShelfError):
    """A tier cannot take a value even after growing to its configured maximum."""


class UnsupportedModelError(KVShelfError):
    """A model whose cache layout kvshelf cannot bridge (not a RoPE decoder with a dynamic KV cache)."""


class ModelLoadError(KVShelfError):
    """A model name or path that cannot be loaded."""


class TierUnavailableError(KVShelfError):
    """A tier's backing service (Redis, a remote server) cannot be reached now; the store degrades around it."""


class TierDamagedError(TierUnavailableError):
    """A tier's storage is structurally damaged (an LMDB file cut short, a garbage page): the tier is skipped
    like an unreachable one (reads miss, writes go to the other tiers) until it is repaired or reset."""


class WriteBehindError(KVShelfError):
    """Blocks handed to a write-behind writer could not be written in time (a flush timed out)."""
