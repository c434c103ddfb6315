"""KV codecs behind one registry (see ``compress.registry``)."""

from compress import raw as _raw  # noqa: F401  (registers the built-in codecs)
from compress.registry import Codec, available_codecs, get_codec, register_codec

__all__ = ["Codec", "available_codecs", "get_codec", "register_codec"]
