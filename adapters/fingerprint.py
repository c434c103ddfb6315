"""The fingerprint of a HF model: what makes its KV interchangeable (see ``kvstore.fingerprint``).

It follows the model: ``model.to(torch.bfloat16)``, ``load_state_dict`` of other weights or an in-place edit of a
sampled weight give another fingerprint at the next call, so a block is never served to the changed model. The
weight digest (the first rows of the first and last dozen parameters) costs a few milliseconds, so it is memoized
on the model, valid while the model's dtype, its config properties and, for each sampled parameter, the tensor
object, its storage, dtype, device and autograd version counter (bumped by every in-place write: ``copy_``,
``load_state_dict``, optimizer steps) stay the same. Measured on SmolLM2 (272 parameters, this 2-core CPU): the
check ~0.8 ms (mostly listing the parameters), the digest ~6.5 ms; on a tiny test model 0.08 ms and 0.5 ms.

Blocks are keyed by dtype (it is one of the properties). ``fingerprint_in_dtype`` gives the fingerprint the model
would have after ``model.to(dtype)`` without converting it: the properties with the dtype swapped, and the digest
of the sampled rows cast to that dtype (the digest reads every dtype as float32, and ``model.to`` casts each value
the same way, round to nearest even), so it costs one more digest and is exact for the cast of these weights. Which
blocks it can find: from a float32 model, those of its bfloat16 and float16 casts; from a bfloat16 (float16)
model, those of a float32 model whose weights are bfloat16 (float16) values, as when both load a bfloat16
(float16) checkpoint, the usual way checkpoints ship. Float32 blocks of a model whose weights have more precision
cannot be named from its lower-precision copy (the lost bits are in their fingerprint), nor a copy whose loader
kept some modules in float32: it finds too few, never blocks of other weights. ``CachedGenerator`` uses it only
when a lookup finds nothing, to say so in its result (``other_dtype_blocks``).
"""

from __future__ import annotations

import copy
import hashlib
import weakref
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from kvshelf.kvstore.errors import UnsupportedModelError
from kvshelf.kvstore.fingerprint import fingerprint_from_properties

_SAMPLE_ROWS = 64
_MEMO = "_kvshelf_fingerprint"


def has_attention_heads(config: PretrainedConfig) -> bool:
    """Whether a decoder's config names its attention heads (a state-space model such as Mamba has none)."""
    return getattr(config.get_text_config(decoder=True), "num_attention_heads", None) is not None


def kv_geometry(model: PreTrainedModel) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a decoder's KV cache (MLA: see ``mla_dims``); ``UnsupportedModelError``
    for a model without attention heads (no KV cache: Mamba and other state-space models)."""
    config = model.config.get_text_config(decoder=True)
    if not has_attention_heads(model.config):
        raise UnsupportedModelError(
            f"{type(model).__name__} (model type {config.model_type}) has no attention heads (its config has no "
            "num_attention_heads): it keeps no KV cache kvshelf can store")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_dims(config: PretrainedConfig) -> dict[str, int | None] | None:
    """The dims of a multi-head latent attention (MLA) decoder (DeepSeek-V2/V3, MiniCPM3), read from its config
    (``MLA_FIELDS``); ``None`` for any other decoder. transformers 5 caches an MLA layer compressed, one head: as
    keys the normalized latent (``kv_lora_rank`` wide, no RoPE), as values the key part every head shares, rotated
    (``qk_rope_head_dim``): a block's keys and values differ in head dim."""
    text = config.get_text_config(decoder=True)
    if getattr(text, "kv_lora_rank", None) is None or getattr(text, "qk_rope_head_dim", None) is None:
        return None
    return {name: getattr(text, name, None) for name in MLA_FIELDS}


def _sampled(model: PreTrainedModel) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the weight digest reads: the first one (the embedding), the next 11 and the last 12."""
    params = list(model.named_parameters())
    return [params[0], *params[1:12], *params[-12:]]


def _weight_sample_digest(sampled: list[tuple[str, torch.nn.Parameter]]) -> bytes:
    """BLAKE2b of the first ``_SAMPLE_ROWS`` rows of each sampled parameter (as float32), with its name."""
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in sampled:
        sample = tensor.detach()[:_SAMPLE_ROWS].to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(sample.numpy().tobytes())
    return h.digest()


def _state(sampled: list[tuple[str, torch.nn.Parameter]]) -> tuple[Any, ...] | None:
    """What the weight digest depends on, cheaply: per sampled parameter its name, storage address, dtype, device,
    shape and version counter; ``None`` when it cannot be told (inference tensors have no version counter)."""
    state = []
    for name, tensor in sampled:
        if tensor.is_inference():
            return None
        state.append((name, tensor.data_ptr(), tensor.dtype, tensor.device, tuple(tensor.shape), tensor._version))
    return tuple(state)


#: the dtypes ``other_dtype_fingerprints`` names (blocks of the same weights in another of these are counted)
COMMON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_MEMO = "_kvshelf_dtype_fingerprints"


def _geometry(model: PreTrainedModel) -> tuple[int | None, int | None, int | None, dict[str, Any]]:
    """``kv_geometry``, plus nothing, for a model with attention heads; for one without (a state-space model:
    Mamba), its layers, ``None`` heads and head dim, and the sizes of its state, so that it has a fingerprint
    too (it has no KV cache to store)."""
    if has_attention_heads(model.config):
        return *kv_geometry(model), {}
    config = model.config.get_text_config(decoder=True)
    state = {name: getattr(config, name) for name in ("hidden_size", "state_size", "conv_kernel", "expand")
             if getattr(config, name, None) is not None}
    return getattr(config, "num_hidden_layers", None), None, None, {"state": state}


def _properties(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, Any]:
    config = model.config.get_text_config(decoder=True)
    layers, kv_heads, head_dim, state = _geometry(model)
    return {
        "architecture": type(model).__name__,
        "model_type": config.model_type,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        **({"mla": mla} if (mla := mla_dims(model.config)) else {}),
        **state,
        "rope": getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None),
        "dtype": str(dtype),
        "vocab": config.vocab_size,
    }


def _memo_valid(memo: Any, properties: dict[str, Any], sampled: list[tuple[str, torch.nn.Parameter]],
                state: tuple[Any, ...] | None) -> bool:
    return (state is not None and memo is not None and memo[2] == state and memo[1] == properties
            and all(ref() is tensor for ref, (_, tensor) in zip(memo[0], sampled, strict=True)))


def _memo(properties: dict[str, Any], sampled: list[tuple[str, torch.nn.Parameter]], state: tuple[Any, ...],
          value: Any) -> tuple[Any, ...]:
    """The parameters by weak reference: a replaced one is never kept alive for this."""
    return tuple(weakref.ref(t) for _, t in sampled), copy.deepcopy(properties), state, value


def model_fingerprint(model: PreTrainedModel) -> str:
    """A stable 32-hex-digit digest of the model as it is now (memoized on the model while it does not change)."""
    properties = _properties(model, model.dtype)
    sampled = _sampled(model)
    state = _state(sampled)
    memo = model.__dict__.get(_MEMO)
    if _memo_valid(memo, properties, sampled, state):
        return memo[3]
    fingerprint = fingerprint_from_properties(properties, _weight_sample_digest(sampled))
    if state is not None:
        model.__dict__[_MEMO] = _memo(properties, sampled, state, fingerprint)
    return fingerprint


def fingerprint_in_dtype(model: PreTrainedModel, dtype: torch.dtype) -> str:
    """The fingerprint ``model.to(dtype)`` would have, computed without converting the model (see the module's
    docstring: exact for the cast of these weights). ``model_fingerprint`` for the model's own dtype."""
    if dtype == model.dtype:
        return model_fingerprint(model)
    return other_dtype_fingerprints(model, (dtype,))[str(dtype)]


def other_dtype_fingerprints(model: PreTrainedModel,
                             dtypes: tuple[torch.dtype, ...] = COMMON_DTYPES) -> dict[str, str]:
    """``{str(dtype): fingerprint_in_dtype(model, dtype)}`` for each of ``dtypes`` other than the model's own
    (memoized on the model like ``model_fingerprint``; ~one weight digest per dtype the first time)."""
    properties = _properties(model, model.dtype)
    sampled = _sampled(model)
    state = _state(sampled)
    memo = model.__dict__.get(_DTYPE_MEMO)
    known: dict[str, str] = dict(memo[3]) if _memo_valid(memo, properties, sampled, state) else {}
    out = {}
    for dtype in dtypes:
        if dtype == model.dtype:
            continue
        if str(dtype) not in known:
            cast = [(name, tensor.detach()[:_SAMPLE_ROWS].to(dtype) if tensor.is_floating_point() else tensor)
                    for name, tensor in sampled]
            known[str(dtype)] = fingerprint_from_properties(_properties(model, dtype), _weight_sample_digest(cast))
        out[str(dtype)] = known[str(dtype)]
    if state is not None:
        model.__dict__[_DTYPE_MEMO] = _memo(properties, sampled, state, known)
    return out


def sampled_parameter_names(model: PreTrainedModel) -> list[str]:
    """Names of the parameters the weight digest reads, in its order (works on a model built on the meta device)."""
    return [name for name, _ in _sampled(model)]


def fingerprint_from_sample(model: PreTrainedModel, dtype: torch.dtype,
                            sampled: list[tuple[str, torch.Tensor]]) -> str:
    """The fingerprint ``model`` has in ``dtype`` when its sampled parameters (``sampled_parameter_names``, in that
    order) hold ``sampled``'s tensors (at least their first rows): how a process without the weights loaded (a vLLM
    engine's scheduler) names the same blocks (``adapters.vllm.fingerprint``)."""
    return fingerprint_from_properties(_properties(model, dtype), _weight_sample_digest(sampled))
