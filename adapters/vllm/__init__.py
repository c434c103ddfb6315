"""kvshelf behind vLLM: ``KVShelfConnector``, a vLLM v1 KV connector over any kvshelf store (docs/vllm.md).

vLLM loads it from ``kv_transfer_config`` (``kv_connector="KVShelfConnector"``,
``kv_connector_module_path="kvshelf.adapters.vllm"``). Importing this package is light: the connector (and vLLM)
load on first use of the name, and nothing here imports ``adapters.hf`` or checks transformers' version.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVShelfConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVShelfConnector":
        from kvshelf.adapters.vllm.connector import KVShelfConnector

        return KVShelfConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
