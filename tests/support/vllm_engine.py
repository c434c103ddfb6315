"""Driving a real vLLM engine (vLLM's CPU build, `make vllm-venv`) in tests: SmolLM2 in float32, eager, a small KV
space, with or without kvshelf's connector; greedy completions of token-id prompts and the connector's report."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

#: tokens per kvshelf block in these tests (the default: two of vLLM's 128-token CPU pages)
BLOCK = 256
MAX_TOKENS = 8

@contextmanager
def engine(model_dir: str, extra: dict[str, Any] | None, **options: Any) -> Iterator[Any]:
    """An ``LLM`` over ``model_dir`` (with kvshelf's connector when ``extra`` is given; ``options``: more of
    ``LLM``'s arguments), shut down on exit."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None if extra is None else KVTransferConfig(
        kv_connector="KVShelfConnector", kv_connector_module_path="kvshelf.adapters.vllm", kv_role="kv_both",
        kv_connector_extra_config=extra)
    settings: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "max_model_len": 2048, "seed": 0,
                                "enable_prefix_caching": False, "disable_log_stats": True}
    llm = LLM(model=model_dir, kv_transfer_config=transfer, **{**settings, **options})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm: Any, prompts: Sequence[Sequence[int]], *, detokenize: bool = True) -> list[Any]:
    """Greedy completions (``MAX_TOKENS`` tokens) of token-id prompts, one ``RequestOutput`` each (``detokenize``
    False for an engine without a tokenizer)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=detokenize)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)


def tokens_of(outputs: Sequence[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def report(output: Any) -> dict[str, int]:
    """What the connector did for one request (its ``kv_transfer_params["kvshelf"]``)."""
    return dict((output.kv_transfer_params or {}).get("kvshelf", {}))


def lmdb_dir(store_dir: Path) -> Path:
    return store_dir / "lmdb"
