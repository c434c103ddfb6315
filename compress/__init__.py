"""KV codecs behind one registry (``kvshelf.kvstore.codec``); importing this package registers them all.

``raw`` (model dtype), ``fp16``, ``bf16``, ``zstd`` (lossless), ``int8``/``int4``/``int2`` (KIVI-style),
``cachegen`` (CacheGen-style entropy coding), ``sparse`` (kept tokens only, any inner codec),
``xquant`` (XQuant latent, needs the model: ``adapters.xquant``).
"""

from kvshelf.compress import bf16 as _bf16  # noqa: F401  (each import registers its codec)
from kvshelf.compress import cachegen as _cachegen  # noqa: F401
from kvshelf.compress import fp16 as _fp16  # noqa: F401
from kvshelf.compress import kivi as _kivi  # noqa: F401
from kvshelf.compress import raw as _raw  # noqa: F401
from kvshelf.compress import sparse as _sparse  # noqa: F401
from kvshelf.compress import xquant as _xquant  # noqa: F401
from kvshelf.compress import xquant_cl as _xquant_cl  # noqa: F401  (xquant's cross_layer=True)
from kvshelf.compress import zstd as _zstd  # noqa: F401
from kvshelf.kvstore.codec import Codec, available_codecs, get_codec, register_codec

__all__ = ["Codec", "available_codecs", "get_codec", "register_codec"]
