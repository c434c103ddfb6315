"""The limits of an encoded block's header: every field a reader sizes memory or work by, bounded in one place.

A header is data from outside (another process, a shared tier, a remote peer): whatever it declares is what a
reader allocates for, so each field has a documented limit, checked before anything is allocated for the block.
Past a limit, a block being *read* is damaged or hostile: ``CorruptBlockError`` naming the field and the limit
(``kvstore.encoding`` checks every header it parses); a block being *written* is refused with ``ConfigError``
(``encode_block``), so that nothing is ever stored that every reader would refuse.

The limits are generous: they stop a hostile header, never a real model. Real models have up to ~160 layers,
up to 128 KV heads (MHA), a head dim of up to 256 (576 for the latent of an MLA model such as DeepSeek-V3; keys
and values of one block may differ in head dim there, each bounded by ``MAX_HEAD_DIM``), and blocks of 16 to a
few thousand tokens. What decoding a block may cost beyond these fields (a codec's working memory, from the
header alone) is ``kvstore.encoding.decode_cost_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: the most layers a block may hold (real models: up to ~160)
MAX_LAYERS = 1024
#: the most KV heads a block may hold (real models: up to 128, multi-head attention without GQA)
MAX_KV_HEADS = 1024
#: the most tokens one block may hold (prefix blocks default to 256; a long RAG chunk is a few thousand; ``xquant``
#: blocks hold at most 65535)
MAX_BLOCK_TOKENS = 1 << 16
#: the largest head dim of keys, and of values (256 on most models, 576 for an MLA latent; K and V may differ)
MAX_HEAD_DIM = 4096
#: the most bytes one block's keys and values may take decoded (a 256-token block of a 405B model in float32 is
#: ~260 MiB; longer contexts are split into blocks)
MAX_BLOCK_DECODED_BYTES = 4 << 30
#: the most bytes decoding one block may take (``kvstore.encoding.decode_cost_bytes``) when a reader is not told
#: otherwise: ``TieredStore`` reads and ``RemoteStore`` fetches (a larger block is a counted miss, kept in its tier);
#: what a ``kvshelf serve`` with the default ``--max-block`` lets through
DEFAULT_MAX_DECODE_BYTES = 256 << 20
#: positions of a block's tokens stay below this: ``start_pos + tokens <= MAX_POSITION`` (2**31: past any context)
MAX_POSITION = 1 << 31
#: token ids are int64 (``kvstore.keys`` hashes them as such)
TOKEN_ID_RANGE = (-(1 << 63), (1 << 63) - 1)
#: the largest quantization group of any codec (``int8``/``int4``/``int2``, ``cachegen``'s anchor groups): a
#: group wider than the block is one group; what a codec allocates per group is bounded by the block either way
MAX_GROUP_SIZE = 1 << 20
#: entries of a block's ``extra`` metadata, and the longest key of one (values: within ``MAX_HEADER_BYTES``)
MAX_EXTRA_ITEMS = 1024
MAX_EXTRA_KEY_CHARS = 256
#: the longest model fingerprint (``kvstore.fingerprint`` makes 32 hex characters) and namespace (the service
#: allows 256 characters)
MAX_FINGERPRINT_CHARS = 1024
MAX_NAMESPACE_CHARS = 1024
#: the longest codec name
MAX_CODEC_NAME_CHARS = 64
#: the longest key a header may name (block keys are 16 bytes; the service's scoped keys are not in headers)
MAX_KEY_BYTES = 64
#: the largest JSON header. A header is mostly its token ids (``MAX_BLOCK_TOKENS`` of them take at most 1.4 MiB,
#: 0.5 MiB for ids below a million) and ``extra``.
MAX_HEADER_BYTES = 2 << 20
#: the most ``[`` and ``{`` bytes a JSON header may hold (a real one has about six containers; brackets inside
#: strings count too). Parsing JSON costs up to ~27x its bytes in Python objects for a list of empty containers,
#: before any field can be checked; without them it is at most ~16x (a list of short strings): 32 MiB at most
#: for a ``MAX_HEADER_BYTES`` header.
MAX_HEADER_CONTAINERS = 4096

def check_shape(shape: Sequence[int], what: str, error: type[Exception]) -> None:
    """``error`` naming ``what``'s field and its limit when ``shape`` ``[layers, kv_heads, tokens, head_dim]`` (of
    keys or values) is not 4 non-negative ints within ``MAX_LAYERS``, ``MAX_KV_HEADS``, ``MAX_BLOCK_TOKENS`` and
    ``MAX_HEAD_DIM``."""
    if len(shape) != 4:
        raise error(f"{what} shape {list(shape)} is not [layers, kv_heads, tokens, head_dim]")
    for name, value, limit in zip(("layers", "kv_heads", "tokens", "head_dim"), shape,
                                  (MAX_LAYERS, MAX_KV_HEADS, MAX_BLOCK_TOKENS, MAX_HEAD_DIM), strict=True):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
            raise error(f"{what} {name} {value!r} is out of range: the limit is {limit} (kvstore.limits)")


def check_block_fields(
    *, codec: str, shapes: Sequence[Sequence[int]], itemsize: int, start_pos: int, token_ids: Sequence[int],
    fingerprint: str, namespace: str, key: bytes, extra: Mapping[str, str], error: type[Exception],
) -> None:
    """``error`` naming the first field of a block header past its limit (see the module docstring).

    ``shapes``: the keys' shape, then the values' (the same today; an MLA block's differ in head dim);
    ``itemsize``: bytes per element of the block's dtype.
    """
    if len(codec) > MAX_CODEC_NAME_CHARS:
        raise error(f"codec name of {len(codec)} characters: the limit is {MAX_CODEC_NAME_CHARS}")
    for what, shape in zip(("keys", "values"), shapes, strict=False):
        check_shape(shape, what, error)
    decoded = sum(_numel(shape) for shape in shapes) * itemsize
    if decoded > MAX_BLOCK_DECODED_BYTES:
        raise error(f"the block's shapes {[list(s) for s in shapes]} decode to {decoded} bytes: the limit is "
                    f"{MAX_BLOCK_DECODED_BYTES} (kvstore.limits.MAX_BLOCK_DECODED_BYTES)")
    tokens = shapes[0][2] if shapes else 0
    if not 0 <= start_pos <= MAX_POSITION - tokens:
        raise error(f"start_pos {start_pos} of a {tokens}-token block is out of range: positions stay below "
                    f"{MAX_POSITION}")
    if token_ids and not TOKEN_ID_RANGE[0] <= min(token_ids) <= max(token_ids) <= TOKEN_ID_RANGE[1]:
        raise error(f"a token id is out of range: token ids are int64 {list(TOKEN_ID_RANGE)}")
    if len(fingerprint) > MAX_FINGERPRINT_CHARS:
        raise error(f"fingerprint of {len(fingerprint)} characters: the limit is {MAX_FINGERPRINT_CHARS}")
    if len(namespace) > MAX_NAMESPACE_CHARS:
        raise error(f"namespace of {len(namespace)} characters: the limit is {MAX_NAMESPACE_CHARS}")
    if len(key) > MAX_KEY_BYTES:
        raise error(f"key of {len(key)} bytes: the limit is {MAX_KEY_BYTES}")
    if len(extra) > MAX_EXTRA_ITEMS:
        raise error(f"extra metadata of {len(extra)} entries: the limit is {MAX_EXTRA_ITEMS}")
    longest = max(map(len, extra), default=0)
    if longest > MAX_EXTRA_KEY_CHARS:
        raise error(f"an extra metadata key of {longest} characters: the limit is {MAX_EXTRA_KEY_CHARS}")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
