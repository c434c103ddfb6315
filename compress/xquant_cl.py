"""``xquant`` with ``cross_layer=True`` (XQuant-CL): each layer's latent predicted from the layers below it.

After XQuant-CL (Tomar et al., "XQuant: Breaking the Memory Wall for LLM Inference with KV Cache
Rematerialization", 2025, section "XQuant-CL"): the layer inputs ``X`` of consecutive layers are close (the
residual stream adds a little per layer), so XQuant-CL stores the first layer's ``X`` and then quantizes only the
accumulated cross-layer deltas, to very few bits. The codec sees a block's keys and values, not ``X``: it
realizes the same idea on ``Z_l = [K_pre | V]`` of layer ``l`` (``[tokens, C]``, ``C = 2 * kv_heads * head_dim``),
which is a linear function of ``X_l``. Since ``X_l`` is ``X_(l-1)`` plus a delta, ``Z_l`` is well predicted by a
linear map of the layers just below (on SmolLM2, ``depth=2``: the residual keeps 8-27% of ``Z_l``'s variance past
the first layers). Per layer ``l``, in order (closed loop, like XQuant-CL's accumulated deltas: the encoder
predicts from what the decoder will have, so quantization errors do not add up over layers):

* ``P_l = [Ẑ_(l-1) | ... | Ẑ_(l-depth) | 1] @ predict[l]`` (``predict``: ``[layers, depth * C + 1, C]``, a
  ridge regression fitted on calibration text; missing layers below layer ``depth`` count as zero; ``P_0 = 0``);
* the residual ``Z_l - P_l`` is coded exactly as ``xquant`` codes a latent (``compress.xquant``): projected on
  the residual's own calibrated basis (``XQuantCLTables.layer.basis``: the eigenvectors of the residual's
  covariance on the calibration text, ``sigma`` its spreads), one uniform step, the four classes, packed symbols
  Huffman-coded by zstd, block means in fp16, sinks in fp16;
* ``Ẑ_l = S_l @ matrix_l + mean_l @ basis_l^T + P_l``: the same float32 operations on both sides.

Error bound (``drop_below=0``): the residual's latent components are within ``step_i / 2``, so each token's
``Ẑ_l`` is within ``sqrt(C) * max_i step_i / 2`` of ``Z_l`` (L2), the same bound as ``xquant`` with
``matmul="fp32"``: the prediction is known to both sides exactly. Keys, values: ``[layers, kv_heads, tokens,
head_dim]``. The payload has the sections of ``xquant``'s with its own format byte (``FORMAT``): a block of the
other setting is a ``CorruptBlockError``, never decoded as this one.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvshelf.compress import xquant as xq
from kvshelf.compress import xquant_kernels
from kvshelf.compress.container import expect_len, pack_sections, unpack_sections
from kvshelf.compress.raw import tensor_bytes
from kvshelf.kvstore.codec import PreparedPayload
from kvshelf.kvstore.errors import ConfigError, CorruptBlockError

if TYPE_CHECKING:
    from kvshelf.compress.xquant import XQuantCodec

FORMAT = 0x43  # the payload format byte of cross-layer blocks (``xquant``'s own blocks: 2)
MAX_DEPTH = 8


@dataclass(frozen=True)
class XQuantCLTables:
    """What ``xquant`` with ``cross_layer=True`` needs of a model.

    ``layer``: ``XQuantTables`` whose ``basis`` ``[layers, C, C]`` and ``sigma`` ``[layers, C]`` are those of each
    layer's prediction residual (layer 0: of its latent itself), with the model's RoPE. ``predict``: ``[layers,
    depth * C + 1, C]`` float32, the linear predictors (rows: the ``depth`` layers below, nearest first, then the
    bias row); ``predict[0]`` is unused (layer 0 has no layer below).
    """

    layer: xq.XQuantTables
    predict: torch.Tensor
    depth: int
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        layers, width = self.layer.layers, self.layer.width
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or not 1 <= self.depth <= MAX_DEPTH:
            raise ConfigError(f"xquant cross-layer tables: depth {self.depth!r} (an integer in 1..{MAX_DEPTH})")
        if tuple(self.predict.shape) != (layers, self.depth * width + 1, width):
            raise ConfigError(f"xquant cross-layer tables: predict {tuple(self.predict.shape)} does not fit "
                              f"{layers} layers of width {width} at depth {self.depth}")
        predict = self.predict.detach().to("cpu", torch.float32).contiguous()
        if not bool(torch.isfinite(predict).all()):
            raise ConfigError("xquant cross-layer tables: predict holds non-finite values")
        object.__setattr__(self, "predict", predict)
        h = hashlib.blake2b(digest_size=12, person=b"xquant-cl")
        h.update(self.layer.digest.encode())
        h.update(struct.pack("<I", self.depth))
        h.update(tensor_bytes(predict))
        object.__setattr__(self, "digest", "cl-" + h.hexdigest())


_BOUND: dict[str, XQuantCLTables] = {}


def bind_cl_tables(tables: XQuantCLTables) -> str:
    """Make ``tables`` available to ``xquant`` with ``cross_layer=True``; return their digest (the ``model``
    param). Their per-layer tables are bound too (``xquant.bind_tables``)."""
    xq.bind_tables(tables.layer)
    _BOUND[tables.digest] = tables
    return tables.digest


def unbind_cl_tables(digest: str) -> None:
    """Forget the cross-layer tables bound under ``digest`` (and their per-layer tables)."""
    tables = _BOUND.pop(digest, None)
    if tables is not None:
        xq.unbind_tables(tables.layer.digest)


def bound_cl_tables(digest: str) -> XQuantCLTables:
    """The cross-layer tables bound under ``digest``; ``XQuantUnboundError`` when there are none."""
    tables = _BOUND.get(digest)
    if tables is None:
        raise xq.XQuantUnboundError(
            f"xquant cross-layer block needs the model tables {digest or '(none given)'!r}, which are not bound in "
            "this process: build the codec parameters with adapters.xquant.xquant_params(model, cross_layer=True) "
            "(or load_cl_tables) first")
    return tables


def save_cl_tables(tables: XQuantCLTables, path: str) -> None:
    """Write ``tables`` to a safetensors file (no pickle)."""
    from safetensors.torch import save_file

    base = tables.layer
    meta = {"kv_heads": str(base.kv_heads), "head_dim": str(base.head_dim), "depth": str(tables.depth),
            "attention_scaling": repr(base.attention_scaling), "digest": tables.digest}
    save_file({"basis": base.basis, "sigma": base.sigma, "inv_freq": base.inv_freq, "predict": tables.predict},
              path, metadata=meta)


def load_cl_tables(path: str) -> XQuantCLTables:
    """Read tables written by ``save_cl_tables``; ``ConfigError`` when the file is not such tables."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
            missing = {"basis", "sigma", "inv_freq", "predict"} - set(fh.keys())
            if missing or "depth" not in meta:
                raise ConfigError(f"{path}: not xquant cross-layer tables: no {sorted(missing) or 'depth'}")
            base = xq.XQuantTables(fh.get_tensor("basis"), fh.get_tensor("sigma"), fh.get_tensor("inv_freq"),
                                   int(meta["kv_heads"]), int(meta["head_dim"]), float(meta["attention_scaling"]))
            tables = XQuantCLTables(base, fh.get_tensor("predict"), int(meta["depth"]))
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{path}: not xquant cross-layer tables: {exc}") from exc
    if meta.get("digest") != tables.digest:
        raise ConfigError(f"{path}: xquant cross-layer tables digest {tables.digest} differs from the stored "
                          f"{meta.get('digest')}")
    return tables


# ---------------------------------------------------------------------------------- shared by both sides
def _predict(tables: XQuantCLTables, done: list[torch.Tensor], layer: int) -> torch.Tensor | None:
    """``P_layer`` ``[T, C]`` from the rebuilt latents ``done`` (``[T, C]`` each, layers ``0..layer - 1``); None for
    layer 0."""
    if layer == 0:
        return None
    width, weights = tables.layer.width, tables.predict[layer]
    pred = weights[-1].expand(done[0].shape[0], width)
    for d in range(min(tables.depth, layer)):  # nearest layer first
        pred = torch.addmm(pred, done[layer - 1 - d], weights[d * width : (d + 1) * width])
    return pred


def _offsets(mean: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """The block means ``[layers, C]`` (float32 of the fp16 stored) back in the ``[K_pre | V]`` domain."""
    return torch.bmm(mean[:, None], basis.transpose(1, 2))[:, 0]


def _rebuild(symbols: torch.Tensor, matrix: torch.Tensor, offset: torch.Tensor,
             pred: torch.Tensor | None) -> torch.Tensor:
    """``Ẑ = S @ matrix + offset (+ P)``: ``symbols`` ``[T, kept]`` float32 in slot order, ``matrix`` ``[kept, C]``."""
    z = torch.addmm(offset.expand(symbols.shape[0], -1), symbols, matrix)
    return z if pred is None else z + pred


def _slot_components(plan: xq._Plan, width: int) -> list[torch.Tensor]:
    """Per layer, the kept components in slot order (the columns of the decoder's ``[T, kept]`` symbols)."""
    layers = plan.class_counts.shape[1]
    out: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    at = 0
    for c in range(plan.class_counts.shape[0]):
        for layer in range(layers):
            n = int(plan.class_counts[c, layer])
            out[layer].append(plan.rows[at : at + n] % width)
            at += n
    return [torch.cat(parts) for parts in out]


def _shape_of(tables: XQuantCLTables, shape: tuple[int, ...]) -> None:
    from kvshelf.kvstore.errors import CodecParamError

    base = tables.layer
    layers, heads, _, dim = shape
    if getattr(shape, "value_head_dim", dim) != dim:
        raise CodecParamError(f"xquant holds blocks whose keys and values share a head dim; this block's are "
                              f"{shape!r}")
    if (layers, heads, dim) != (base.layers, base.kv_heads, base.head_dim):
        raise CodecParamError(f"xquant cross-layer tables {tables.digest} are for {base.layers} layers x "
                              f"{base.kv_heads} kv heads x {base.head_dim}, the block is {layers} x {heads} x {dim}")


def _sinks(codec: XQuantCodec, tables: XQuantCLTables, z: torch.Tensor) -> torch.Tensor:
    """Token indices (int64, sorted) to keep in fp16: ``xquant``'s rule (``XQuantCodec._sinks``: latent energy in
    calibration spreads, ``sink_ratio`` x the median token's or more) on each layer's open-loop residual (predicted
    from the exact layers below), ``z``: ``[layers, T, C]``."""
    if codec.max_sinks == 0 or z.shape[1] < 4:
        return torch.empty(0, dtype=torch.int64)
    exact = list(z)
    residual = torch.stack([z[layer] if layer == 0 else z[layer] - _predict(tables, exact, layer)  # type: ignore[operator]
                            for layer in range(z.shape[0])])
    return codec._sinks(torch.bmm(residual, tables.layer.basis), tables.layer)


# ------------------------------------------------------------------------------------------------ encode
def encode(codec: XQuantCodec, keys: torch.Tensor, values: torch.Tensor, start_pos: int) -> list[bytes | memoryview]:
    """The payload of a block (keys, values ``[layers, kv_heads, tokens, head_dim]``, first token at ``start_pos``)."""
    tables = bound_cl_tables(codec.model)
    base = tables.layer
    shape = tuple(int(s) for s in keys.shape)
    _shape_of(tables, shape)
    layers, heads, tokens, dim = shape
    plan = codec._plan()
    if tokens == 0:
        return pack_sections([xq._HEAD.pack(FORMAT, 0, 0, 0), *[b""] * (xq._SECTIONS - 1)])
    k = keys.detach().to("cpu", torch.float32).clamp(-xq._HALF_MAX, xq._HALF_MAX)
    v = values.detach().to("cpu", torch.float32).clamp(-xq._HALF_MAX, xq._HALF_MAX)
    cos, sin = xq._cos_sin(base.digest, start_pos, tokens)
    k_pre = xq._rope(k.transpose(1, 2), cos, sin, inverse=True)  # [L, T, H, D]
    z = torch.cat([k_pre.reshape(layers, tokens, -1), v.transpose(1, 2).reshape(layers, tokens, -1)], dim=-1)
    sinks = _sinks(codec, tables, z)
    regular = torch.ones(tokens, dtype=torch.bool)
    regular[sinks] = False
    slots = _slot_components(plan, base.width)
    means = torch.empty(layers, base.width, dtype=torch.float16)
    symbols = torch.empty(layers, tokens, base.width, dtype=torch.int32)
    done: list[torch.Tensor] = []
    for layer in range(layers):  # closed loop: each layer predicted from the rebuilt layers below
        pred = _predict(tables, done, layer)
        latent = (z[layer] if pred is None else z[layer] - pred) @ base.basis[layer]  # [T, C]
        mean = latent[regular].mean(dim=0) if regular.any() else torch.zeros(base.width)
        means[layer] = mean.clamp(-xq._HALF_MAX, xq._HALF_MAX).half()
        centred = (latent - means[layer].float()) / plan.steps[layer]
        centred[sinks] = 0.0
        symbols[layer] = torch.round(centred).clamp(-xq._SYMBOL_LIMIT, xq._SYMBOL_LIMIT).to(torch.int32)
        offset = _offsets(means[layer : layer + 1].float(), base.basis[layer : layer + 1])[0]
        kept = plan.layer_widths[layer]
        done.append(_rebuild(symbols[layer][:, slots[layer]].float(), plan.matrix[layer, :kept], offset, pred))
    flat = symbols.transpose(1, 2).reshape(layers * base.width, tokens)[plan.rows]  # stream order
    streams, escaped, row = [], [], 0
    for c, size in enumerate(plan.class_sizes):  # each class layer by layer, token-major within a layer
        per_layer = flat[row : row + size].split(plan.class_counts[c].tolist())
        packed, esc = xq._pack(torch.cat([part.t().reshape(-1) for part in per_layer]), *xq._SCHEMES[c])
        streams.append(xq._zstd(packed))
        escaped.append(esc)
        row += size
    esc_values = torch.cat(escaped).to(torch.int32)
    sink_kv = torch.stack([k[:, :, sinks], v[:, :, sinks]]).half()  # [2, L, H, sinks, D]
    sink_section = sinks.to(torch.int32).numpy().tobytes() + bytes(tensor_bytes(sink_kv))
    head = xq._HEAD.pack(FORMAT, tokens, len(sinks), len(esc_values))
    return pack_sections([head, tensor_bytes(means), sink_section, xq._zstd(bytes(tensor_bytes(esc_values))),
                          *streams])


# ------------------------------------------------------------------------------------------------ decode
def prepare(codec: XQuantCodec, payload: memoryview, shape: tuple[int, int, int, int], start_pos: int, *,
            verified: bool = False) -> XQuantCLPayload:
    """Check ``payload`` and entropy-decode its symbols (``CorruptBlockError`` when damaged or of another format);
    the layer-by-layer rebuild waits for ``write``."""
    tables = bound_cl_tables(codec.model)
    _shape_of(tables, shape)
    layers, heads, tokens, dim = shape
    width_c = tables.layer.width
    plan = codec._plan()
    sections = unpack_sections(payload, xq._SECTIONS, xq.NAME, verified=verified)
    rows = np.empty(len(plan.rows) * tokens, dtype=np.int8)  # every symbol is written by the unpack
    no_sinks = (np.empty(0, dtype=np.int64), np.empty((2, layers, heads, 0, dim), dtype=np.float16))
    if tokens == 0:
        if any(len(sec) for sec in sections[1:]) or bytes(sections[0]) != xq._HEAD.pack(FORMAT, 0, 0, 0):
            raise CorruptBlockError("xquant cross-layer payload of an empty block is not empty")
        return XQuantCLPayload(codec, shape, start_pos, rows, np.empty(0, np.int64), np.empty(0, np.int32),
                               np.zeros((layers, width_c), dtype=np.float32), *no_sinks)
    head = bytes(expect_len(sections[0], xq._HEAD.size, "head", xq.NAME))
    fmt, n_tokens, n_sinks, n_escapes = xq._HEAD.unpack(head)
    total = len(plan.rows) * tokens
    if fmt != FORMAT:
        raise CorruptBlockError(f"xquant payload format {fmt} is not the cross-layer format {FORMAT}: a block of "
                                "another xquant setting")
    if n_tokens != tokens or n_sinks > min(codec.max_sinks, tokens) or n_escapes > total:
        raise CorruptBlockError(f"xquant cross-layer payload head ({n_tokens} tokens, {n_sinks} sinks, "
                                f"{n_escapes} escapes) does not fit a block of {tokens} tokens")
    mean = np.frombuffer(expect_len(sections[1], layers * width_c * 2, "means", xq.NAME), dtype=np.float16)
    mean = mean.astype(np.float32).reshape(layers, width_c)
    sink_bytes = expect_len(sections[2], 4 * n_sinks + 2 * layers * heads * n_sinks * dim * 2, "sinks", xq.NAME)
    esc_values = np.frombuffer(xq._unzstd(sections[3], 4 * n_escapes, "escapes"), dtype=np.int32)
    streams = [xq._unzstd(sections[4 + c], -(-size * tokens // xq._SCHEMES[c][0]), f"class {c} stream")
               for c, size in enumerate(plan.class_sizes)]
    unpack = xq._unpack_fused if xquant_kernels.AVAILABLE else xq._unpack_numpy
    rows, escapes, esc_values = unpack(streams, plan.class_sizes, tokens, esc_values, rows)
    where, sink_kv = no_sinks
    if n_sinks:
        where = np.frombuffer(sink_bytes[: 4 * n_sinks], dtype=np.int32).astype(np.int64)
        if where.min() < 0 or where.max() >= tokens or len(np.unique(where)) != n_sinks:
            raise CorruptBlockError("xquant cross-layer payload: sink token index out of range or repeated")
        sink_kv = np.frombuffer(sink_bytes[4 * n_sinks :], dtype=np.float16).reshape(2, layers, heads, n_sinks,
                                                                                     dim).copy()
    return XQuantCLPayload(codec, shape, start_pos, rows, escapes, esc_values, mean, where, sink_kv)


class XQuantCLPayload(PreparedPayload):
    """A cross-layer ``xquant`` block checked and entropy-decoded (the attributes of ``xquant.XQuantPayload``);
    ``write`` rebuilds it layer by layer on the CPU (each layer needs the ones below it)."""

    def __init__(self, codec: XQuantCodec, shape: tuple[int, int, int, int], start_pos: int, rows: np.ndarray,
                 escapes: np.ndarray, escape_values: np.ndarray, mean: np.ndarray, sinks: np.ndarray,
                 sink_kv: np.ndarray) -> None:
        self.codec, self.shape, self.start_pos = codec, shape, start_pos
        self.num_tokens = shape[2]
        self.rows, self.escapes, self.escape_values = rows, escapes, escape_values
        self.mean, self.sinks, self.sink_kv = mean, sinks, sink_kv

    def write(self, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        tokens = self.num_tokens
        if tokens == 0:
            return
        tables = bound_cl_tables(self.codec.model)
        base = tables.layer
        layers, heads, _, _ = self.shape
        plan = self.codec._plan()
        cos, sin = xq._cos_sin(base.digest, self.start_pos, tokens)
        offsets = _offsets(torch.from_numpy(self.mean), base.basis)
        with xquant_kernels.worker_pool() as pool:
            symbols = xq._symbol_matrices([self], plan, tokens, [0], pool)  # type: ignore[list-item]
        wide = xq._wide_escapes([self], plan, [0])  # type: ignore[list-item]
        done: list[torch.Tensor] = []
        for layer in range(layers):
            s = symbols[layer].float()
            if layer in wide:  # symbols beyond int8
                where, slot, value = wide[layer]
                s[where, slot] = value
            kept = plan.layer_widths[layer]
            done.append(_rebuild(s, plan.matrix[layer, :kept], offsets[layer], _predict(tables, done, layer)))
            k, v = xq._rotate_split(done[layer], cos, sin, heads)
            keys_out[layer].copy_(k.transpose(0, 1))
            values_out[layer].copy_(v.transpose(0, 1))
        if len(self.sinks):  # the fp16 sink tokens, over every layer at once
            sinks = torch.from_numpy(self.sinks)
            keys_out[:, :, sinks] = torch.from_numpy(self.sink_kv[0]).to(keys_out.dtype)
            values_out[:, :, sinks] = torch.from_numpy(self.sink_kv[1]).to(values_out.dtype)


class _CrossLayer:
    """This module as ``xquant``'s ``CrossLayerCoding``."""

    def layer_digest(self, digest: str) -> str:
        return bound_cl_tables(digest).layer.digest

    def layer_digest_and_depth(self, digest: str) -> tuple[str, int] | None:
        tables = _BOUND.get(digest)
        return None if tables is None else (tables.layer.digest, tables.depth)

    def encode(self, codec: XQuantCodec, keys: torch.Tensor, values: torch.Tensor,
               start_pos: int) -> list[bytes | memoryview]:
        return encode(codec, keys, values, start_pos)

    def prepare(self, codec: XQuantCodec, payload: memoryview, shape: tuple[int, int, int, int], start_pos: int, *,
                verified: bool = False) -> PreparedPayload:
        return prepare(codec, payload, shape, start_pos, verified=verified)


xq.register_cross_layer(_CrossLayer())
