"""Decode working memory, bounded from the header before anything is decoded (issue H2, the Hadamard bomb).

* The fast Walsh-Hadamard rotation equals the dense product and is its own inverse.
* Every header field past its limit (``kvstore.limits``) is ``CorruptBlockError`` naming the field and the limit.
* For every registered codec, the most hostile blocks its limits admit are decoded in a child process (every
  decode path: ``decode_block``, ``prepare_block`` + ``write``, the codec's own ``decode``) and the peak RSS
  growth is measured (``/proc/self/clear_refs`` resets the peak; torch allocations are invisible to
  tracemalloc): it stays within ``decode_cost_bytes`` (+ ``DECODE_OVERHEAD_BYTES``), or the block is refused
  before anything is allocated. The bombs (a 8192-dim rotated ``cachegen`` block, a zstd frame declaring 1 GiB,
  a KIVI group of 2**20, a header of 15 MiB of brackets) each grew the old decoder by hundreds of MiB.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import constriction
import numpy as np
import pytest
import torch
import xxhash
import zstandard
from helpers import REPO_ROOT

from kvshelf.compress import available_codecs, cachegen, get_codec
from kvshelf.compress.container import pack_sections
from kvshelf.compress.hadamard import factors, hadamard, rotate
from kvshelf.compress.sparse import mark_dropped
from kvshelf.compress.xquant import XQuantTables, bind_tables, save_tables
from kvshelf.kvstore import KVBlock
from kvshelf.kvstore import limits as L
from kvshelf.kvstore.codec import Codec, block_numel, numel
from kvshelf.kvstore.encoding import (
    decode_block,
    decode_cost_bytes,
    decoded_nbytes,
    encode_block,
    read_header,
)
from kvshelf.kvstore.errors import ConfigError, CorruptBlockError

MiB = 1 << 20
KEY = b"k" * 16
#: measurement slack: page rounding, the allocator's arenas, Python objects of the result, the decode's fixed
#: costs (``DECODE_OVERHEAD_BYTES`` is their documented bound; these blocks take far less)
SLACK = 4 * MiB
#: growth allowed for a block refused before decoding (the header parsed, the payload checksummed)
REFUSED_GROWTH = 8 * MiB


# -- the rotation -----------------------------------------------------------------------------------------------


def _dense(d: int) -> torch.Tensor:
    """Sylvester's ``H_d / sqrt(d)`` in float64, built here by Kronecker products (independent of the module)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h / math.sqrt(d)


@pytest.mark.parametrize("d", [1 << k for k in range(11)])
def test_fwht_equals_the_dense_product(d: int) -> None:
    x = torch.randn(3, 5, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    assert torch.allclose(rotate(x), x @ _dense(d), atol=1e-12, rtol=0)
    x32 = x.float()
    assert torch.allclose(rotate(x32).double(), x32.double() @ _dense(d), atol=2e-6 * math.log2(2 * d), rtol=0)


@pytest.mark.parametrize("d", [1, 2, 64, 256, 512, 2048, 8192])
def test_fwht_is_orthonormal_and_its_own_inverse(d: int) -> None:
    x = torch.randn(7, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = rotate(x)
    assert torch.allclose(rotate(y), x, atol=1e-12)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-12)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert math.prod(factors(d)) == d and max(factors(d)) <= 256


def test_small_rotations_are_the_dense_float32_product_bit_for_bit() -> None:
    """Up to 256 the rotation is one product with the float32 ``H / sqrt(d)`` the codec always used, so
    ``cachegen`` blocks encoded before decode to the same numbers."""
    for d in (4, 64, 128, 256):
        x = torch.randn(9, d, generator=torch.Generator().manual_seed(d))
        old = _dense(d).float()  # the old module's (H / sqrt(d)).float()
        assert torch.equal(hadamard(d), old)
        assert torch.equal(rotate(x), x @ old)


def test_rotation_rejects_other_sizes() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        rotate(torch.zeros(2, 12))


def test_cachegen_rotated_blocks_stay_within_their_documented_bound() -> None:
    """Decode through the fast transform: within ``error_bound`` (sqrt(head_dim) * step / 2 per element)."""
    for dim in (64, 512):
        g = torch.Generator().manual_seed(dim)
        keys, values = torch.randn(2, 2, 24, dim, generator=g), torch.randn(2, 2, 24, dim, generator=g)
        codec = get_codec("cachegen", {"rotate": True, "sink_ratio": 0.0})
        payload = memoryview(b"".join(bytes(p) for p in codec.encode(keys, values)))
        k, v = codec.decode(payload, tuple(keys.shape), torch.float32, True)
        bound = codec.error_bound(keys, values)  # [2, layers]
        for n, (x, y) in enumerate(((keys, k), (values, v))):
            err = (x - y).abs().amax(dim=(1, 2, 3))
            assert torch.all(err <= bound[n] * 1.001 + 1e-5), (dim, err, bound[n])


# -- header limits ----------------------------------------------------------------------------------------------


def frame(header: dict[str, Any], payload: bytes) -> bytes:
    """An encoded block with this header (JSON as given) and payload, checksummed: how a hostile peer makes one."""
    text = json.dumps(header, separators=(",", ":")).encode()
    body = b"KVSH" + struct.pack("<HI", 1, len(text)) + text + payload
    return body + xxhash.xxh3_64_digest(body)


def header_of(codec: str, params: dict, shape: tuple[int, ...], payload_len: int, dtype: str = "float32",
              **over: Any) -> dict[str, Any]:
    fields = {"codec": codec, "params": params, "shape": list(shape), "dtype": dtype, "payload_len": payload_len,
              "start_pos": 0, "token_ids": list(range(shape[2])), "fingerprint": "fp", "namespace": "default",
              "key": KEY.hex(), "extra": {}}
    return {**fields, **over}


def raw_block(shape: tuple[int, int, int, int], **over: Any) -> bytes:
    payload = bytes(2 * numel(shape) * 4)
    return frame(header_of("raw", {}, shape, len(payload), **over), payload)


@pytest.mark.parametrize(("shape", "over", "field", "limit"), [
    ((L.MAX_LAYERS + 1, 1, 1, 1), {}, "layers", L.MAX_LAYERS),
    ((1, L.MAX_KV_HEADS + 1, 1, 1), {}, "kv_heads", L.MAX_KV_HEADS),
    ((1, 1, L.MAX_BLOCK_TOKENS + 1, 1), {}, "tokens", L.MAX_BLOCK_TOKENS),
    ((1, 1, 1, L.MAX_HEAD_DIM + 1), {}, "head_dim", L.MAX_HEAD_DIM),
    ((1, 1, 2, 1), {"start_pos": L.MAX_POSITION - 1}, "start_pos", L.MAX_POSITION),
    ((1, 1, 1, 1), {"token_ids": [1 << 63]}, "token id", "int64"),
    ((1, 1, 1, 1), {"fingerprint": "f" * (L.MAX_FINGERPRINT_CHARS + 1)}, "fingerprint", L.MAX_FINGERPRINT_CHARS),
    ((1, 1, 1, 1), {"namespace": "n" * (L.MAX_NAMESPACE_CHARS + 1)}, "namespace", L.MAX_NAMESPACE_CHARS),
    ((1, 1, 1, 1), {"extra": {str(i): "" for i in range(L.MAX_EXTRA_ITEMS + 1)}}, "extra", L.MAX_EXTRA_ITEMS),
    ((1, 1, 1, 1), {"extra": {"k" * (L.MAX_EXTRA_KEY_CHARS + 1): ""}}, "extra metadata key", L.MAX_EXTRA_KEY_CHARS),
    ((1, 1, 1, 1), {"key": "ab" * (L.MAX_KEY_BYTES + 1)}, "key", L.MAX_KEY_BYTES),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_header_field_past_its_limit_is_a_damaged_block(shape, over, field, limit) -> None:  # noqa: ANN001
    if field == "tokens":  # no payload: the header is refused first
        value = frame(header_of("raw", {}, shape, 0), b"")
    else:
        value = frame(header_of("raw", {}, shape, 2 * numel(shape) * 4, **over), bytes(2 * numel(shape) * 4))
    with pytest.raises(CorruptBlockError, match=field) as excinfo:
        decode_block(value)
    assert str(limit) in str(excinfo.value)
    with pytest.raises(CorruptBlockError, match=field):
        read_header(value)


def test_the_decoded_size_and_the_header_size_are_bounded() -> None:
    shape = (L.MAX_LAYERS, L.MAX_KV_HEADS, 16, 64)  # every field within its limit, 8 GiB decoded
    value = frame(header_of("raw", {}, shape, 0), b"")
    with pytest.raises(CorruptBlockError, match="MAX_BLOCK_DECODED_BYTES"):
        read_header(value)
    with pytest.raises(CorruptBlockError, match="brackets"):
        read_header(frame(header_of("raw", {}, (1, 1, 1, 1), 8, extra={"x": "[" * 5000}), bytes(8)))
    big = b"KVSH" + struct.pack("<HI", 1, L.MAX_HEADER_BYTES + 1) + bytes(L.MAX_HEADER_BYTES + 9)
    with pytest.raises(CorruptBlockError, match=str(L.MAX_HEADER_BYTES)):
        read_header(big)


@pytest.mark.parametrize(("codec", "params", "field"), [
    ("int8", {"group_size": L.MAX_GROUP_SIZE + 1}, "group_size"),
    ("int4", {"group_size": 1 << 40}, "group_size"),
    ("cachegen", {"group_size": L.MAX_GROUP_SIZE + 1}, "group_size"),
    ("cachegen", {"bits": 9}, "bits"),
    ("zstd", {"level": 99}, "level"),
    ("sparse", {"inner": "int8", "inner_params": {"group_size": 0}}, "group_size"),
    ("xquant", {"max_sinks": 1 << 20}, "max_sinks"),
])
def test_codec_parameters_past_their_limits_are_a_damaged_block(codec: str, params: dict, field: str) -> None:
    shape = (1, 1, 4, 8)
    value = frame(header_of(codec, params, shape, 64), bytes(64))
    with pytest.raises(CorruptBlockError):  # (its payload may be refused first)
        decode_block(value)
    with pytest.raises(CorruptBlockError, match=field):
        decode_cost_bytes(read_header(value))


def test_blocks_past_the_limits_are_never_written() -> None:
    block = KVBlock(torch.zeros(1, 1, 2, 8192), torch.zeros(1, 1, 2, 8192), (0, 1), 0, "fp")
    with pytest.raises(ConfigError, match="head_dim"):
        encode_block(block, KEY, "cachegen", {"rotate": True})
    block = KVBlock(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), (0,), L.MAX_POSITION, "fp")
    with pytest.raises(ConfigError, match="start_pos"):
        encode_block(block, KEY)


def test_every_codec_states_its_decode_workspace() -> None:
    for name in available_codecs():
        cls = type(get_codec(name)) if name != "xquant" else type(get_codec(name, {"model": "x"}))
        assert cls.decode_workspace_bytes.__func__ is not Codec.decode_workspace_bytes.__func__, name


# -- measured decode memory -------------------------------------------------------------------------------------

#: the child: for each case, a warm-up decode (lazy imports, kernels, thread pools), then the block's decode with
#: the peak RSS reset before it; prints [{"name", "outcome", "peak"}] (bytes of VmHWM over the RSS before)
CHILD = r"""
import ctypes, gc, json, sys
import torch
torch.set_num_threads(1)
from kvshelf.kvstore.codec import get_codec
from kvshelf.kvstore.encoding import DTYPES, decode_block, prepare_block
from kvshelf.kvstore.errors import KVShelfError

libc = ctypes.CDLL("libc.so.6")

def status(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

def settle():
    gc.collect()
    libc.malloc_trim(0)

def run(case, data, warm=False):
    if case["mode"] == "decode":
        block = decode_block(data)
        return block.keys, block.values
    if case["mode"] == "prepare":
        prepared = prepare_block(data)
        keys = torch.empty(prepared.shape.keys, dtype=prepared.dtype)
        values = torch.empty(prepared.shape.values, dtype=prepared.dtype)  # MLA: another head dim
        prepared.payload.write(keys, values)
        return prepared, keys, values
    codec = get_codec(case["codec"], case["params"])
    shape = case["warm_shape"] if warm and "warm_shape" in case else case["shape"]
    return codec.decode(memoryview(data), tuple(shape), DTYPES[case["dtype"]], True)

cases = json.load(open(sys.argv[1]))
if any(c.get("tables") for c in cases):
    from kvshelf.compress.xquant import bind_tables, load_tables
    bind_tables(load_tables(next(c["tables"] for c in cases if c.get("tables"))))
gc.collect()
gc.freeze()  # what is loaded stays: the collections between cases only walk what the decodes made
out = []
for case in cases:
    if case.get("warm"):
        try:
            result = run(case, open(case["warm"], "rb").read(), warm=True)
        except KVShelfError:
            pass
        result = None
    data = open(case["path"], "rb").read()
    settle()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    base = status("VmRSS")
    try:
        result = run(case, data)
        outcome = "ok"
    except KVShelfError as exc:
        result, outcome = None, f"{type(exc).__name__}: {exc}"[:300]
    peak = status("VmHWM") - base
    del result, data
    settle()
    out.append({"name": case["name"], "outcome": outcome, "peak": peak})
print(json.dumps(out))
"""


def _run_child(spec: Path) -> list[dict]:
    """``CHILD`` on the cases in ``spec``, in a fresh interpreter whose allocator maps every buffer of 64 KiB or more
    on its own (glibc's ``M_MMAP_THRESHOLD``, fixed: no heap reuse), so its RSS is what the decode allocates."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 10), "PYTHONHASHSEED": "0"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(spec)], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"the measuring child failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def _tensors(shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    """Hostile contents: ``gauss``, ``bimodal`` (+-1: every cachegen flag set, half the signs), ``tails`` (a few
    values 10**4 larger: wide symbols and escapes), ``smooth`` (zeros: every zstd plane compresses), ``big``
    (beyond fp16: saturation)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "bimodal":
        return torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    if kind == "smooth":
        return torch.zeros(shape)
    x = torch.randn(shape, generator=g)
    if kind == "tails":
        x[torch.rand(shape, generator=g) < 0.01] *= 1e4
    return x


class Cases:
    """Blocks written to ``root`` and the cases that decode them, with what each case asserts."""

    def __init__(self, root: Path) -> None:
        self.root, self.cases, self.checks = root, [], {}

    def add(self, name: str, value: bytes, warm: bytes | None, *, mode: str = "decode", refused: str | None = None,
            direct: dict | None = None, tables: str | None = None) -> None:
        path, warm_path = self.root / f"{name}.bin", self.root / f"{name}.warm"
        path.write_bytes(value)
        case = {"name": name, "path": str(path), "mode": "codec" if direct else mode, "tables": tables}
        if warm is not None:
            warm_path.write_bytes(warm)
            case["warm"] = str(warm_path)
        if direct:
            case.update(direct)
        self.cases.append(case)
        self.checks[name] = (value, refused, mode)

    def block(self, name: str, codec: str, params: dict, shape: tuple[int, int, int, int], *, kind: str = "gauss",
              dtype: torch.dtype = torch.float32, modes: tuple[str, ...] = ("decode", "prepare"),
              drop: bool = False, tables: str | None = None, value_head_dim: int | None = None) -> None:
        """A real block encoded with ``codec`` and hostile contents, decoded on each path of ``modes``;
        ``value_head_dim``: values of another head dim than the keys' (MLA)."""
        def make(tokens: int, seed: int) -> bytes:
            keys = _tensors((*shape[:2], tokens, shape[3]), kind, seed).to(dtype)
            values = _tensors((*shape[:2], tokens, value_head_dim or shape[3]), kind, seed + 1).to(dtype)
            block = KVBlock(keys, values, tuple(range(tokens)), 0, "fp")
            if drop:
                block = mark_dropped(block, list(range(0, tokens, 2)))
            return encode_block(block, KEY, codec, params)

        value, warm = make(shape[2], 1), make(min(shape[2], 4), 7)
        for mode in modes:
            self.add(f"{name}-{mode}", value, warm, mode=mode, tables=tables)


def _xquant_tables(root: Path) -> tuple[XQuantTables, str]:
    """Random tables of a small model (2 layers, 2 KV heads, head dim 16: C = 64), bound here and saved for the
    child."""
    g = torch.Generator().manual_seed(5)
    basis = torch.linalg.qr(torch.randn(2, 64, 64, generator=g, dtype=torch.float64))[0].float()
    tables = XQuantTables(basis, torch.ones(2, 64), 1.0 / (10000 ** (torch.arange(8) / 8)), 2, 16)
    bind_tables(tables)
    path = root / "tables.safetensors"
    save_tables(tables, str(path))
    return tables, str(path)


def _zstd_bomb() -> bytes:
    """A ``zstd`` block of shape [1, 1, 64, 32] float32 (8 KiB a plane) whose first plane is an ~8 KiB frame of
    zeros declaring (and holding) 256 MiB: within the payload size the shape allows; the other planes are small
    frames of the right size."""
    n, size = 64 * 32, 256 << 20
    sink = io.BytesIO()
    with zstandard.ZstdCompressor(write_content_size=True).stream_writer(sink, size=size, closefd=False) as writer:
        for _ in range(size >> 20):
            writer.write(bytes(1 << 20))
    small = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(n))
    payload = b"".join(bytes(p) for p in pack_sections([bytes([1] * 8), sink.getvalue(), *[small] * 7]))
    return frame(header_of("zstd", {"level": 3}, (1, 1, 64, 32), len(payload)), payload)


def _cachegen_wide(shape: tuple[int, int, int, int], params: dict) -> bytes:
    """A ``cachegen`` block no encoder writes, the decoder's worst case: every flag set with a negative sign, fine
    bits of widths 15 and 16 (int32 symbols, two width groups), so every working array of the decode is at its
    largest (``CacheGenCodec.decode_workspace_bytes``'s symbol phase)."""
    layers, heads, tokens, dim = shape
    streams, per_stream = 2 * layers, heads * tokens * dim
    assert per_stream % 16 == 0
    r = np.full(streams, 16, dtype=np.uint8)
    r[0] = 15
    words = np.full((streams, per_stream // 16), 0xFFFF, dtype=np.uint16)  # 16 set flags: an escaped word
    joint = cachegen._TO_SYMBOL[words]
    p = np.full(streams, 0.5, dtype=np.float16)
    coder = constriction.stream.stack.AnsCoder()
    for s in range(streams - 1, -1, -1):
        coder.encode_reverse(joint[s].astype(np.int32), cachegen._flag_model(float(p[s])))
    rng = np.random.default_rng(0)
    fine = b"".join(cachegen._pack_planes(rng.integers(0, 1 << int(w), (int((r == w).sum()), per_stream)), int(w))
                    for w in np.unique(r))
    sections = [cachegen._FORMAT_TAG, r.tobytes(), bytes(-(-streams * heads * dim // 8)),
                bytes(2 * streams * heads * dim), np.ones(streams, np.float16).tobytes(), p.tobytes(),
                coder.get_compressed().astype("<u4").tobytes(), fine, b"\xff" * (streams * per_stream // 8),
                b"", b"", words[joint == cachegen._ESCAPE_WORD].astype("<u2").tobytes(), b"", b"", b"", b""]
    payload = b"".join(bytes(part) for part in pack_sections(sections))
    return frame(header_of("cachegen", params, shape, len(payload)), payload)


def _kivi_bomb() -> bytes:
    """An ``int8`` block whose header says ``group_size`` 2**30 over a real payload of one group per row (what
    any group of at least the row's width gives): the old decoder padded every row to 2**30 values."""
    shape = (2, 2, 16, 16)
    keys = _tensors(shape, "gauss", 4)
    payload = b"".join(bytes(p) for p in get_codec("int8", {"group_size": 32}).encode(keys, keys))
    return frame(header_of("int8", {"group_size": 1 << 30}, shape, len(payload)), payload)


def _bracket_bomb(nbytes: int) -> bytes:
    """A raw block whose header carries ``nbytes`` of empty JSON lists (``[],``: ~27x their size once parsed)."""
    return frame(header_of("raw", {}, (1, 1, 1, 1), 8, pad=[[]] * (nbytes // 3)), bytes(8))


def _cases(root: Path) -> Cases:
    c = Cases(root)
    hd = L.MAX_HEAD_DIM
    # -- the bombs: refused from the header, or decoded in memory proportional to the block
    shape = (1, 1, 2, 8192)
    keys = _tensors(shape, "gauss", 3)
    payload = b"".join(bytes(p) for p in get_codec("cachegen", {"rotate": True}).encode(keys, keys))
    c.add("bomb-hadamard-header", frame(header_of("cachegen", {"rotate": True}, shape, len(payload)), payload), None,
          refused="CorruptBlockError")
    small = _tensors((1, 1, 2, 64), "gauss", 3)  # the warm-up: another head dim (an old decoder kept its matrix)
    warm = b"".join(bytes(p) for p in get_codec("cachegen", {"rotate": True}).encode(small, small))
    c.add("bomb-hadamard-codec", payload, warm, direct={"codec": "cachegen", "params": {"rotate": True},
                                                         "shape": list(shape), "warm_shape": [1, 1, 2, 64],
                                                         "dtype": "float32"})
    c.add("bomb-zstd-frame", _zstd_bomb(), None, refused="CorruptBlockError")
    c.add("bomb-kivi-group", _kivi_bomb(), None, refused="CorruptBlockError")
    c.add("bomb-header-15mib", _bracket_bomb(15 * MiB), None, refused="CorruptBlockError")
    c.add("bomb-header-brackets", _bracket_bomb(L.MAX_HEADER_BYTES - 4096), None, refused="CorruptBlockError")
    # -- every codec at its most hostile settings (~8 MiB decoded), on every decode path
    c.block("raw-f32", "raw", {}, (1, 2, 256, hd))
    c.block("raw-f64", "raw", {}, (1, 2, 128, hd), dtype=torch.float64)
    c.block("fp16-f32", "fp16", {}, (1, 2, 256, hd), kind="big")
    c.block("bf16-f64", "bf16", {}, (1, 2, 128, hd), dtype=torch.float64)
    c.block("bf16-f16", "bf16", {}, (1, 2, 512, hd), dtype=torch.float16)
    c.block("zstd-f32-smooth", "zstd", {"level": -7}, (1, 2, 256, hd), kind="smooth")
    c.block("zstd-f64-gauss", "zstd", {}, (1, 2, 128, hd), dtype=torch.float64)
    for bits in (8, 4, 2):
        c.block(f"int{bits}-g1", f"int{bits}", {"group_size": 1}, (2, 2, 128, 512))
        c.block(f"int{bits}-gmax-f16", f"int{bits}", {"group_size": L.MAX_GROUP_SIZE}, (4, 4, 100, 384),
                dtype=torch.float16)
    c.block("int4-g3-f16", "int4", {"group_size": 3}, (3, 4, 257, 160), dtype=torch.float16)
    hostile = {"rotate": True, "group_size": 2, "bits": 5, "early_extra_bits": 3, "early_fraction": 1.0}
    c.block("cachegen-rot-maxdim", "cachegen", hostile, (2, 1, 128, hd))
    c.block("cachegen-rot-bimodal-f16", "cachegen", hostile, (2, 2, 256, 1024), kind="bimodal", dtype=torch.float16)
    c.block("cachegen-tails", "cachegen", {"bits": 7, "sink_ratio": 0.99}, (4, 2, 256, 256), kind="tails")
    c.block("cachegen-f64", "cachegen", {"group_size": L.MAX_GROUP_SIZE}, (2, 2, 256, 256), dtype=torch.float64)
    wide = {"rotate": True, "group_size": 2}
    for mode in ("decode", "prepare"):
        c.add(f"cachegen-crafted-wide-{mode}", _cachegen_wide((8, 2, 256, 256), wide),
              _cachegen_wide((8, 2, 8, 256), wide), mode=mode)
    c.block("sparse-cachegen", "sparse", {"inner": "cachegen", "inner_params": hostile}, (2, 1, 128, hd),
            drop=True)
    c.block("sparse-zstd-f16", "sparse", {"inner": "zstd", "fill": "zero"}, (1, 2, 512, hd), drop=True,
            kind="smooth", dtype=torch.float16)
    # -- keys and values of different head dims (MLA), each codec's widest case: cachegen pads the narrower
    c.block("raw-mla", "raw", {}, (4, 1, 256, 512), value_head_dim=64)
    c.block("fp16-mla-vwide", "fp16", {}, (2, 2, 256, 64), value_head_dim=hd, kind="big")
    c.block("bf16-mla-f64", "bf16", {}, (2, 1, 128, hd), value_head_dim=8, dtype=torch.float64)
    c.block("zstd-mla", "zstd", {}, (2, 1, 256, hd), value_head_dim=64)
    c.block("int8-mla-g1", "int8", {"group_size": 1}, (2, 1, 128, 512), value_head_dim=64)
    c.block("int2-mla-vwide-g3", "int2", {"group_size": 3}, (2, 2, 128, 64), value_head_dim=512)
    c.block("cachegen-mla-rot-kwide", "cachegen", hostile, (2, 1, 128, hd), value_head_dim=8)
    c.block("cachegen-mla-rot-vwide-f16", "cachegen", hostile, (2, 1, 128, 8), value_head_dim=hd,
            dtype=torch.float16)
    c.block("sparse-mla-cachegen", "sparse", {"inner": "cachegen", "inner_params": hostile}, (2, 1, 128, hd),
            value_head_dim=8, drop=True)
    tables, path = _xquant_tables(root)
    for matmul, dtype in (("int8", torch.float32), ("fp32", torch.float16), ("bf16", torch.float32)):
        params = {"model": tables.digest, "step": 1e-3, "drop_below": 0.0, "max_sinks": 64, "sink_ratio": 1.01,
                  "matmul": matmul}  # every symbol an escape beyond int8, 64 sinks, a plan built for the block
        c.block(f"xquant-{matmul}", "xquant", params, (2, 2, 8192, 16), dtype=dtype, tables=path)
    return c


def _table(results: list[dict], checks: dict) -> list[str]:
    lines = []
    for r in results:
        value, _, _ = checks[r["name"]]
        try:
            header = read_header(value)
            decoded, cost = decoded_nbytes(header), decode_cost_bytes(header)
        except Exception:  # noqa: BLE001 - refused headers have no cost
            decoded = cost = 0
        lines.append(f"{r['name']:32s} decoded {decoded / MiB:8.2f} MiB  cost {cost / MiB:8.2f} MiB  "
                     f"peak {r['peak'] / MiB:8.2f} MiB  {r['outcome'][:60]}")
    return lines


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _clear_refs_works(),
                    reason="peak RSS is measured through /proc/self/clear_refs (Linux)")
def test_decode_memory_stays_within_its_stated_cost(tmp_path: Path) -> None:
    cases = _cases(tmp_path)
    names = {case["name"].split("-")[0] for case in cases.cases}
    assert set(available_codecs()) <= names, "a registered codec has no hostile case"
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases.cases))
    results = _run_child(spec)
    print("\n".join(_table(results, cases.checks)))
    failures = []
    for r in results:
        value, refused, _ = cases.checks[r["name"]]
        if refused is not None:
            if not r["outcome"].startswith(refused) or r["peak"] > REFUSED_GROWTH:
                failures.append(f"{r['name']}: expected {refused} within {REFUSED_GROWTH} bytes, got {r}")
            continue
        if r["name"] == "bomb-hadamard-codec":
            bound = 128 * MiB
        else:
            header = read_header(value)
            bound = decode_cost_bytes(header) + SLACK
            elements = block_numel(header.shape)
            proportional = 48 * elements + 16 * header.payload_len + (0 if header.codec != "xquant" else 64 * MiB)
            if decode_cost_bytes(header) > decoded_nbytes(header) + proportional:
                failures.append(f"{r['name']}: cost {decode_cost_bytes(header)} not proportional to the block")
        if r["outcome"] != "ok" or r["peak"] > bound:
            failures.append(f"{r['name']}: {r['outcome']}, peak {r['peak']} > {bound}")
    assert not failures, "\n".join(failures)


def test_decode_cost_grows_with_the_block_not_with_a_parameter() -> None:
    """The stated cost of every codec at its most hostile parameters is proportional to the decoded size (and the
    payload): eight times the tokens, at most ~eight times the cost; a one-token block costs little."""
    for codec, params in [("raw", {}), ("fp16", {}), ("bf16", {}), ("zstd", {"level": 22}),
                          ("int8", {"group_size": L.MAX_GROUP_SIZE}), ("int4", {"group_size": 1}), ("int2", {}),
                          ("cachegen", {"rotate": True, "group_size": 2}), ("sparse", {"inner": "cachegen"})]:
        costs = []
        for tokens in (1, 8, 64):
            shape = (4, 2, tokens, L.MAX_HEAD_DIM)
            codec_ = get_codec(codec, params)
            payload_len = 2 * numel(shape) * 4  # a generous payload
            costs.append(type(codec_).decode_workspace_bytes(codec_.params(), shape, 4, payload_len))
            assert costs[-1] <= 48 * 2 * numel(shape) + 16 * payload_len, (codec, tokens, costs)
        assert costs[2] <= 9 * costs[1] and costs[1] <= 9 * costs[0], (codec, costs)
