"""What the connector cannot do it refuses at engine start, with one line naming what is wrong: bad settings in
``kv_connector_extra_config``, a server that cannot be reached, a model family it cannot move exactly. Each case
starts an engine in a subprocess (vLLM's own error ends that process) and reads its output."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(("extra", "words"), [
    ({"store": "embedded:///tmp/kvshelf-refused?disk_codec=int9"}, "int9"),
    ({"store": "lmdb-please://here"}, "unknown scheme 'lmdb-please://'"),
    ({"store": "grpc://127.0.0.1:{port}?connect_timeout=1"}, "unreachable"),
])
def test_bad_settings_are_refused_at_engine_start(model_dir: str, tmp_path: Path, extra: dict, words: str) -> None:
    extra = {k: v.replace("{port}", str(_free_port())) if isinstance(v, str) else v for k, v in extra.items()}
    code, output = start(model_dir, extra, tmp_path)
    assert code != 0 and "ENGINE STARTED" not in output
    lines = refusal_lines(output)
    assert lines and all(words in line for line in lines), output[-3000:]
    assert lines[-1].startswith("RuntimeError: Worker failed with error 'kvshelf connector refused to start: ")


def test_sliding_window_model_is_refused_at_engine_start(tmp_path: Path) -> None:
    """A family whose pages are not the whole prefix's K/V (every layer a sliding window): refused, named."""
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
