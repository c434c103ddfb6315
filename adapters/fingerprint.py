"""The fingerprint of a HF model: what makes its KV interchangeable (see ``kvstore.fingerprint``)."""

from __future__ import annotations

import hashlib

import torch
from transformers import PreTrainedModel

from kvshelf.kvstore.fingerprint import fingerprint_from_properties

_SAMPLE_ROWS = 64


def kv_geometry(model: PreTrainedModel) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a decoder's KV cache."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def _weight_sample_digest(model: PreTrainedModel) -> bytes:
    """BLAKE2b of a few weight tensors: the first rows of every 2-D parameter of the first and last layers."""
    h = hashlib.blake2b(digest_size=16)
    params = list(model.named_parameters())
    chosen = [params[0], *params[1:12], *params[-12:]]
    for name, tensor in chosen:
        sample = tensor.detach()[:_SAMPLE_ROWS].to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(sample.numpy().tobytes())
    return h.digest()


def model_fingerprint(model: PreTrainedModel) -> str:
    """A stable 32-hex-digit digest; cached on the model object."""
    cached = getattr(model, "_kvshelf_fingerprint", None)
    if cached is not None:
        return cached
    config = model.config.get_text_config(decoder=True)
    layers, kv_heads, head_dim = kv_geometry(model)
    properties = {
        "architecture": type(model).__name__,
        "model_type": config.model_type,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "rope": getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None),
        "dtype": str(model.dtype),
        "vocab": config.vocab_size,
    }
    fingerprint = fingerprint_from_properties(properties, _weight_sample_digest(model))
    model._kvshelf_fingerprint = fingerprint
    return fingerprint
