"""Errors of the context-reuse layer (all are ``kvstore.errors.KVShelfError``; input errors are also ``ValueError``)."""

from __future__ import annotations

from kvshelf.kvstore.errors import ConfigError, KVShelfError


class ReuseError(KVShelfError):
    """Base class of the reuse layer's errors."""


class SchemaError(ReuseError, ConfigError):
    """A prompt-module schema that cannot be used: bad markup, overlapping position ranges, a bad slot."""


class UnknownModuleError(ReuseError, ConfigError):
    """A prompt names a module its schema does not declare."""


class UnknownParameterError(ReuseError, ConfigError):
    """A prompt gives a value for a parameter its module does not declare."""


class MissingParameterError(ReuseError, ConfigError):
    """A prompt leaves a declared parameter of a module it uses without a value."""


class ParameterTooLongError(ReuseError, ConfigError):
    """A parameter value has more tokens than its slot reserves."""


class PromptLayoutError(ReuseError, ConfigError):
    """Modules out of schema order, used twice, or free text running into a later module's reserved range."""


class ContextTooLongError(ReuseError, ConfigError):
    """The assembled prompt (plus the tokens to generate) needs more positions than the model has."""


class ChunkMissingError(ReuseError):
    """A chunk's KV is not in the store for this model (never computed, evicted, or stored by another model).

    Attributes (``None`` when not known): ``index`` (the chunk's place in the call, after splitting), ``kind``
    (``"chunk"``: the position-0 chunk, ``"block"``: the block after the shared prefix, ``"prefix"``: the prefix's
    own KV), ``mode`` (the mode that needs it), ``reason`` (``"other-kind"``: stored only as the other kind, i.e.
    precomputed for other modes or another prefix; ``"other-dtype"``: stored for the same weights in another dtype;
    ``"absent"``: never precomputed for this model and namespace, evicted, or another model's; ``"no-store"``)."""

    def __init__(self, message: str, *, index: int | None = None, kind: str | None = None, mode: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.index, self.kind, self.mode, self.reason = index, kind, mode, reason


class ForeignChunkError(ReuseError):
    """A chunk's KV belongs to another model (fingerprint) and is never used."""
