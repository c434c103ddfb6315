"""What the connector cannot do it refuses at engine start, with one line naming what is wrong: bad settings in
``kv_connector_extra_config``, a server that cannot be reached, a model family it cannot move exactly. One real
engine start (in a subprocess: vLLM's own error ends that process) shows the line reaching vLLM's error; the bad
settings are refused by the connector's constructor, which vLLM calls with its config at engine start: these cases
build vLLM's real config for SmolLM2 (``EngineArgs.create_engine_config``: no weights loaded, no engine) and the KV
cache config vLLM's CPU backend gives it (one group of full-attention layers, 128-token pages), and construct the
connector in each role directly."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvshelf.kvstore.errors import KVShelfError

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys
from vllm_engine import engine
if __name__ == "__main__":
    model, extra = sys.argv[1], json.loads(sys.argv[2])
    with engine(model, extra, skip_tokenizer_init=True):
        print("ENGINE STARTED")
"""
SUPPORT = Path(__file__).resolve().parents[1] / "support"


def start(model: str, extra: dict, tmp_path: Path) -> tuple[int, str]:
    script = tmp_path / "start_engine.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), model, json.dumps(extra)], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(SUPPORT)})
    return proc.returncode, proc.stdout + proc.stderr


def refusal_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "kvshelf connector refused to start:" in line]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _refusal(model_dir: str, extra: dict, role_name: str) -> Exception:
    """The error the connector raises when constructed with vLLM's config of ``model_dir`` and ``extra``."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvshelf.adapters.vllm import KVShelfConnector

    transfer = KVTransferConfig(kv_connector="KVShelfConnector", kv_connector_module_path="kvshelf.adapters.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra)
    config = EngineArgs(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=2048,
                        kv_transfer_config=transfer).create_engine_config()
    model, parallel = config.model_config, config.parallel_config
    spec = FullAttentionSpec(block_size=config.cache_config.block_size, num_kv_heads=model.get_num_kv_heads(parallel),
                             head_size=model.get_head_size(), dtype=model.dtype)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(parallel))]
    kv_cache = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    with pytest.raises(KVShelfError) as caught:
        connector = KVShelfConnector(config, KVConnectorRole[role_name], kv_cache)
        connector.shutdown()
    return caught.value


@pytest.mark.parametrize(("extra", "words"), [
    ({"store": "embedded://{tmp}?disk_codec=int9"}, "int9"),
    ({"store": "lmdb-please://here"}, "unknown scheme 'lmdb-please://'"),
    ({"store": "grpc://127.0.0.1:{port}?connect_timeout=1"}, "unreachable"),
    ({"store": "embedded://{tmp}", "compression": "zstd"}, "unknown key(s) 'compression'"),
    ({"store": "embedded://{tmp}", "block_tokens": 200}, "not a multiple of vLLM's block size 128"),
    ({"store": "embedded://{tmp}", "load_failure_policy": "retry"}, "load_failure_policy"),
])
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_bad_settings_are_refused_at_engine_start(model_dir: str, tmp_path: Path, extra: dict, words: str,
                                                  role: str) -> None:
    extra = {k: v.replace("{port}", str(_free_port())).replace("{tmp}", str(tmp_path / "store"))
             if isinstance(v, str) else v for k, v in extra.items()}
    error = _refusal(model_dir, extra, role)
    text = str(error)
    assert text.startswith("kvshelf connector refused to start: ") and "\n" not in text, text
    assert words in text, text


def test_sliding_window_model_is_refused_at_engine_start(tmp_path: Path) -> None:
    """A family whose pages are not the whole prefix's K/V (every layer a sliding window): the real engine start
    ends with the connector's line, naming the model and why."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=64,
                           max_position_embeddings=2048)
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral-sliding")
    code, output = start(str(tmp_path / "mistral-sliding"), {"store": f"embedded://{tmp_path / 'store'}"}, tmp_path)
    assert code != 0 and "ENGINE STARTED" not in output
    lines = refusal_lines(output)
    assert lines and "MistralForCausalLM" in lines[-1] and "sliding" in lines[-1], output[-3000:]
    assert lines[-1].startswith("RuntimeError: Worker failed with error 'kvshelf connector refused to start: ")
