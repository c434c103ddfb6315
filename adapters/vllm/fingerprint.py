"""The kvshelf fingerprint of a checkpoint folder, without loading its weights: the same string
``adapters.fingerprint.model_fingerprint(load_model(folder, dtype))`` gives, so a vLLM engine's blocks carry the
keys ``CachedGenerator`` computes for the same tokens.

The HF model is built from the folder's config on the meta device (no memory, no weights: its class, config
properties and parameter names, in order), then the first rows of the parameters the digest samples are read from
the folder's safetensors by name and cast to ``dtype`` as ``from_pretrained(dtype=...)`` casts them. Costs: the meta
build (~0.1-0.5 s) and reading 24 x 64 rows. A sampled parameter missing from the checkpoint (another naming) is an
``UnsupportedModelError``: the fingerprint could not be the HF one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvshelf.kvstore.errors import ModelLoadError, UnsupportedModelError

_SAMPLE_ROWS = 64


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Parameter name -> the safetensors file holding it (one file, or a sharded checkpoint's index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{folder}: no model.safetensors (nor an index of shards): kvshelf reads the "
                             "checkpoint's safetensors to fingerprint the model")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


def meta_model(folder: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The HF causal LM of ``folder``'s config, built on the meta device in ``dtype`` (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the config of {folder}: {str(exc).splitlines()[0]}") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def checkpoint_fingerprint(folder: str | Path, dtype: torch.dtype) -> str:
    """kvshelf's fingerprint of the model in ``folder`` loaded in ``dtype`` (see the module docstring)."""
    return fingerprint_of(meta_model(folder, dtype), folder, dtype)


def fingerprint_of(model: torch.nn.Module, folder: str | Path, dtype: torch.dtype) -> str:
    """``checkpoint_fingerprint`` for ``model``, the ``meta_model`` of ``folder`` in ``dtype``."""
    from safetensors import safe_open

    from kvshelf.adapters.fingerprint import fingerprint_from_sample, sampled_parameter_names

    folder = Path(folder)
    files = _tensor_files(folder)
    sampled: list[tuple[str, torch.Tensor]] = []
    for name in sampled_parameter_names(model):  # type: ignore[arg-type]
        if name not in files:
            raise UnsupportedModelError(
                f"{type(model).__name__}: parameter {name!r} is not in the checkpoint of {folder} under that name; "
                "kvshelf cannot fingerprint it as the HF model")
        with safe_open(str(files[name]), framework="pt") as f:
            rows = f.get_slice(name)[:_SAMPLE_ROWS]
        sampled.append((name, rows.to(dtype)))
    return fingerprint_from_sample(model, dtype, sampled)  # type: ignore[arg-type]
