"""One vLLM engine process for ``kvshelf bench vllm``, driven over JSON lines (no pickle).

This file runs in another virtualenv than kvshelf's (``.venv-vllm``, or LMCache's own): it imports vLLM and the
standard library only, never kvshelf. The bench copies it to a temporary folder and starts it with that venv's
python. Protocol, one JSON object a line:

* in, first line: ``{"model", "transfer": null | {kv_connector, kv_connector_module_path?, kv_role,
  kv_connector_extra_config}, "prefix_caching", "kv_blocks", "max_model_len", "seed"}``;
  out: ``@@ {"ok": true, "block_size"}`` once the engine runs (or ``@@ {"error": "..."}``).
* in: ``{"op": "generate", "prompts": [[token ids], ...], "max_tokens"}``: the prompts submitted together, greedy;
  out: ``@@ {"wall_s", "outputs": [{"tokens", "ttft_s", "tpot_s", "cached_tokens", "kvshelf"}, ...]}``.
* in: ``{"op": "quit"}``: the engine is shut down (the connector's write-behind queue drained) and the process
  ends.

``ttft_s`` is vLLM's own first-token latency of the request (arrival to first token), ``tpot_s`` the mean time
between its output tokens (engine-core timestamps), ``cached_tokens`` the prompt tokens vLLM did not compute (its
prefix cache plus a connector's loads). Only ``@@ `` lines on stdout are replies: vLLM logs there too.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def start(config: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = config.get("transfer")
    return LLM(model=config["model"], dtype="float32", enforce_eager=True, seed=config.get("seed", 0),
               max_model_len=config["max_model_len"], enable_prefix_caching=config["prefix_caching"],
               num_gpu_blocks_override=config["kv_blocks"], disable_log_stats=False,
               kv_transfer_config=KVTransferConfig(**transfer) if transfer else None)


def one(output: Any) -> dict[str, Any]:
    """What the bench needs of one ``RequestOutput``."""
    tokens = list(output.outputs[0].token_ids)
    metrics = output.metrics
    ttft = tpot = None
    if metrics is not None:
        ttft = float(metrics.first_token_latency) or None
        if len(tokens) > 1 and metrics.last_token_ts > metrics.first_token_ts > 0:
            tpot = (metrics.last_token_ts - metrics.first_token_ts) / (len(tokens) - 1)
    params = output.kv_transfer_params or {}
    return {"tokens": tokens, "ttft_s": ttft, "tpot_s": tpot, "cached_tokens": int(output.num_cached_tokens or 0),
            "kvshelf": params.get("kvshelf")}


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - started
    return {"wall_s": wall, "outputs": [one(o) for o in outputs]}


def main() -> None:
    config = json.loads(sys.stdin.readline())
    try:
        llm = start(config)
    except Exception as exc:  # the engine's own refusal, reported as one line to the bench
        reply({"error": f"{type(exc).__name__}: {exc}"})
        return
    reply({"ok": True, "block_size": llm.llm_engine.vllm_config.cache_config.block_size})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            reply(generate(llm, cmd["prompts"], cmd["max_tokens"]))
        elif cmd["op"] == "quit":
            break
    llm.llm_engine.engine_core.shutdown()
    reply({"ok": True})


if __name__ == "__main__":
    main()
