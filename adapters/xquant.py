"""Binding a HF model to the ``xquant`` codec: its latent basis, calibration spreads and RoPE (``compress.xquant``).

``xquant_params(model, calibration=...)`` computes the model's ``XQuantTables``, binds them in this process and
returns the codec parameters (``{"model": digest, ...}``) to give a tier or ``encode_block``. Blocks encoded with
them decode wherever the same tables are bound: in this process, or in another one after ``load_tables`` of a
file written by ``save_tables`` (recomputing the tables elsewhere may differ in the last float bits, hence have
another digest, and then decoding says the tables are not bound rather than returning wrong tensors).

The basis (XQuant, Tomar et al. 2025; see ``compress.xquant``): the latent of ``X`` from which ``[K_pre | V]``
is rematerialized. ``basis="svd"``: the left singular vectors of ``[W_k; W_v]`` (XQuant's GQA latent, from the
weights alone). ``basis="klt"`` (default): the same latent with the SVD taken in the metric of the
activations (SVD-LLM, Wang et al. 2024; Palu, Chang et al. 2024), i.e. the eigenvectors of the covariance of
``[K_pre | V]`` on the calibration tokens; it needs fewer bits for the same error. The calibration text should
look like the traffic (pass ``calibration`` token ids); without it, seeded random tokens are used (it works,
at a worse rate).

``cross_layer=True`` (XQuant-CL, ``compress.xquant_cl``): ``xquant_cl_tables`` fits, on the same calibration
text, each layer's linear prediction from the ``depth`` layers below (ridge regression, closed loop: the layers
below as the decoder rebuilds them at the calibration step) and the KLT basis of what is left.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from kvshelf.adapters import hf
from kvshelf.adapters.fingerprint import kv_geometry, mla_dims
from kvshelf.compress.xquant import XQuantTables, bind_tables, keep_plan
from kvshelf.compress.xquant_cl import XQuantCLTables, bind_cl_tables
from kvshelf.kvstore.errors import ConfigError, UnsupportedModelError
from kvshelf.reuse.rope import rope_cos_sin, unrope

CALIBRATION_CHUNK = 1024
_SKIP = 4  # first tokens of every calibration chunk left out of the statistics (attention sinks)
_SEED = 20250815


def _rotary(model: PreTrainedModel) -> tuple[torch.Tensor, float]:
    """The model's RoPE ``inv_freq`` ``[head_dim / 2]`` and attention scaling."""
    try:
        rotary = hf.rotary(model)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"xquant: {exc}") from None
    return rotary.inv_freq, rotary.attention_scaling


def _unrope(keys: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """Pre-RoPE keys ``[layers, heads, tokens, dim]`` of keys rotated at positions ``0..tokens-1``."""
    cos, sin = rope_cos_sin(torch.arange(keys.shape[2]), inv_freq, scaling=scaling)  # [tokens, dim / 2]
    return unrope(keys, cos, sin, scaling)


def _latents(model: PreTrainedModel, ids: Sequence[int], inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[layers, tokens, C]`` float64 rows ``[K_pre | V]`` of the calibration tokens (chunks, sinks left out)."""
    rows = []
    device = next(model.parameters()).device
    for s in range(0, len(ids), CALIBRATION_CHUNK):
        chunk = list(ids[s : s + CALIBRATION_CHUNK])
        if len(chunk) <= 2 * _SKIP:
            continue
        with torch.no_grad():
            cache = model(torch.tensor([chunk], device=device), use_cache=True).past_key_values
        layers_kv = hf.cache_tensors(cache)  # per layer (keys, values) [1, kv_heads, tokens, head_dim]
        keys = torch.stack([k[0] for k, _ in layers_kv]).to("cpu", torch.float32)
        values = torch.stack([v[0] for _, v in layers_kv]).to("cpu", torch.float32)
        k_pre = _unrope(keys, inv_freq, scaling)
        layers, _, tokens, _ = keys.shape
        z = torch.cat([k_pre.permute(0, 2, 1, 3).reshape(layers, tokens, -1),
                       values.permute(0, 2, 1, 3).reshape(layers, tokens, -1)], dim=-1)
        rows.append(z[:, _SKIP:].double())
    if not rows:
        raise ConfigError(f"xquant calibration needs more than {2 * _SKIP} tokens, got {len(ids)}")
    return torch.cat(rows, dim=1)


def _fix_signs(basis: torch.Tensor) -> torch.Tensor:
    """Each column's largest-magnitude entry made positive (singular vectors are defined up to sign)."""
    pivot = basis.abs().argmax(dim=1, keepdim=True)
    return basis * torch.sign(torch.gather(basis, 1, pivot)).clamp_min(0).mul(2).sub(1)


def xquant_tables(
    model: PreTrainedModel, calibration: Sequence[int] | None = None, *, basis: str = "klt",
    calibration_tokens: int = 4096,
) -> XQuantTables:
    """Compute the ``XQuantTables`` of ``model`` from ``calibration`` token ids (seeded random ids when None).

    ``basis``: ``"klt"`` (activation-aware SVD latent, default) or ``"svd"`` (SVD of ``[W_k; W_v]``).
    """
    if basis not in ("klt", "svd"):
        raise ConfigError(f"xquant basis must be 'klt' or 'svd', got {basis!r}")
    if mla_dims(model.config) is not None:  # its cache is already a latent: K and V of different dims, no W_k/W_v
        raise UnsupportedModelError(f"xquant does not support model type "
                                    f"{model.config.get_text_config(decoder=True).model_type!r}: multi-head latent "
                                    "attention (MLA) caches a compressed latent and a rotated key part of "
                                    "different head dims, not keys and values of per-head K/V projections")
    layers, kv_heads, head_dim = kv_geometry(model)
    inv_freq, scaling = _rotary(model)
    if inv_freq.shape != (head_dim // 2,):
        raise UnsupportedModelError(f"xquant: rotary inv_freq {tuple(inv_freq.shape)} does not fit head_dim "
                                    f"{head_dim} (partial rotary is not supported)")
    if calibration is None:
        vocab = model.config.get_text_config(decoder=True).vocab_size
        gen = torch.Generator().manual_seed(_SEED)
        calibration = torch.randint(0, vocab, (calibration_tokens,), generator=gen).tolist()
    z = _latents(model, list(calibration)[:calibration_tokens], inv_freq, scaling)  # [L, N, C]
    centred = z - z.mean(dim=1, keepdim=True)
    cov = centred.transpose(1, 2) @ centred / z.shape[1]  # [L, C, C]
    if basis == "klt":
        _, vectors = torch.linalg.eigh(cov)
        vectors = vectors.flip(-1)
    else:
        w = torch.stack([torch.cat([w_k, w_v]).to("cpu", torch.float64)
                         for w_k, w_v in hf.kv_projection_weights(model)])  # [L, C, hidden]
        if w.shape[1] != 2 * kv_heads * head_dim:
            raise UnsupportedModelError(f"xquant: k/v projections of width {w.shape[1]}, expected "
                                        f"{2 * kv_heads * head_dim}")
        vectors = torch.linalg.svd(w, full_matrices=False)[0]
    vectors = _fix_signs(vectors)
    sigma = torch.einsum("lci,lcd,ldi->li", vectors, cov, vectors).clamp_min(0).sqrt()
    return XQuantTables(vectors.float(), sigma.float(), inv_freq, kv_heads, head_dim, scaling)


def _klt(resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eigenvectors (by decreasing energy, signs fixed) ``[C, C]`` and spreads ``[C]`` of ``resid``'s
    covariance (``resid``: ``[N, C]`` float64)."""
    centred = resid - resid.mean(dim=0, keepdim=True)
    cov = centred.T @ centred / resid.shape[0]
    vectors = _fix_signs(torch.linalg.eigh(cov)[1].flip(-1)[None])[0]  # [1, C, C]: signs per column
    return vectors, torch.einsum("ci,cd,di->i", vectors, cov, vectors).clamp_min(0).sqrt()


def xquant_cl_tables(
    model: PreTrainedModel, calibration: Sequence[int] | None = None, *, depth: int = 2, ridge: float = 1e-3,
    fit_step: float = 0.35, calibration_tokens: int = 4096,
) -> XQuantCLTables:
    """The ``XQuantCLTables`` of ``model`` from ``calibration`` token ids (seeded random ids when None).

    Per layer ``l`` (XQuant-CL, Tomar et al. 2025, on ``Z = [K_pre | V]``): a ridge regression (``ridge`` times
    the mean diagonal of the Gram matrix) of ``Z_l`` on the ``depth`` layers below and a bias, fitted on those
    layers as the decoder rebuilds them (their residuals quantized at ``fit_step`` in their own basis: the closed
    loop the codec runs), then the KLT basis and spreads of the residual. ``Z``: ``[layers, N, C]``.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 8:
        raise ConfigError(f"xquant cross-layer depth must be an integer in 1..8, got {depth!r}")
    if not ridge >= 0 or not fit_step > 0:
        raise ConfigError(f"xquant cross-layer ridge must be >= 0 and fit_step > 0, got {ridge!r}, {fit_step!r}")
    if mla_dims(model.config) is not None:
        raise UnsupportedModelError("xquant does not support multi-head latent attention (MLA) models")
    layers, kv_heads, head_dim = kv_geometry(model)
    inv_freq, scaling = _rotary(model)
    if calibration is None:
        vocab = model.config.get_text_config(decoder=True).vocab_size
        gen = torch.Generator().manual_seed(_SEED)
        calibration = torch.randint(0, vocab, (calibration_tokens,), generator=gen).tolist()
    z = _latents(model, list(calibration)[:calibration_tokens], inv_freq, scaling)  # [L, N, C]
    n, width = z.shape[1], z.shape[2]
    predict = torch.zeros(layers, depth * width + 1, width, dtype=torch.float64)
    bases, sigmas, rebuilt = [], [], []
    for layer in range(layers):
        below = min(depth, layer)
        if below:
            x = torch.cat([rebuilt[layer - 1 - d] for d in range(below)] + [torch.ones(n, 1, dtype=z.dtype)], 1)
            gram = x.T @ x
            penalty = ridge * gram.diagonal()[:-1].mean()
            gram[range(below * width), range(below * width)] += penalty
            weights = torch.linalg.solve(gram, x.T @ z[layer])  # [below * C + 1, C]
            predict[layer, : below * width], predict[layer, -1] = weights[:-1], weights[-1]
            pred = x @ weights
        else:
            pred = torch.zeros_like(z[layer])
        vectors, sigma = _klt(z[layer] - pred)
        bases.append(vectors)
        sigmas.append(sigma)
        latent = (z[layer] - pred) @ vectors
        mean = latent.mean(dim=0)
        rebuilt.append((torch.round((latent - mean) / fit_step) * fit_step + mean) @ vectors.T + pred)
    tables = XQuantTables(torch.stack(bases).float(), torch.stack(sigmas).float(), inv_freq, kv_heads, head_dim,
                          scaling)
    return XQuantCLTables(tables, predict.float(), depth)


def _calibration_key(calibration: Sequence[int] | None) -> tuple[bool, str]:
    """What names a calibration in the per-model tables cache: default or not, and a digest of its tokens."""
    ids = np.asarray(list(calibration) if calibration is not None else [], dtype=np.int64)
    return calibration is None, hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


def bind_xquant(model: PreTrainedModel, calibration: Sequence[int] | None = None, *, basis: str = "klt") -> str:
    """Compute and bind the tables of ``model`` (cached on the model per basis and calibration); return their
    digest."""
    key = (basis, *_calibration_key(calibration))
    cache: dict[tuple[str, bool, str], XQuantTables] = model.__dict__.setdefault("_kvshelf_xquant", {})
    tables = cache.get(key)
    if tables is None:
        tables = cache[key] = xquant_tables(model, calibration, basis=basis)
    return bind_tables(tables)


def bind_xquant_cl(model: PreTrainedModel, calibration: Sequence[int] | None = None, *, depth: int = 2) -> str:
    """Compute and bind the cross-layer tables of ``model`` (cached on the model per depth and calibration);
    return their digest."""
    key = (depth, *_calibration_key(calibration))
    cache: dict[tuple[int, bool, str], XQuantCLTables] = model.__dict__.setdefault("_kvshelf_xquant_cl", {})
    tables = cache.get(key)
    if tables is None:
        tables = cache[key] = xquant_cl_tables(model, calibration, depth=depth)
    return bind_cl_tables(tables)


def xquant_params(
    model: PreTrainedModel, calibration: Sequence[int] | None = None, *, basis: str = "klt", depth: int = 2,
    **codec_params: Any,
) -> dict[str, Any]:
    """Codec parameters for ``xquant`` on ``model`` (its tables computed and bound, and the decode plan of these
    parameters built and kept: ``compress.xquant.keep_plan``); ``codec_params`` are added. With
    ``cross_layer=True`` among them: the cross-layer tables of ``depth`` (``xquant_cl_tables``; ``basis`` must be
    ``"klt"``)."""
    if codec_params.get("cross_layer") is True:
        if basis != "klt":
            raise ConfigError(f"xquant cross_layer uses the residuals' KLT basis, not basis={basis!r}")
        params = {"model": bind_xquant_cl(model, calibration, depth=depth), **codec_params}
        keep_plan(params)
        return params
    params = {"model": bind_xquant(model, calibration, basis=basis), **codec_params}
    keep_plan(params)
    return params
