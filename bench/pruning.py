"""``kvshelf bench pruning``: token pruning and selection on SmolLM2, with NVIDIA kvpress as the anchor.

Two protocols, budgets 50% / 25% / 12.5% of the prompt:

* **needle QA**: ``cases`` prompts of ~1,300 tokens (corpus abstracts with one planted sentence holding a random
  4-digit code, then a question asking for it); greedy answer of ``new_tokens`` tokens; correct when the code is
  in it. The whole prompt (context + question) is prefilled and compressed, as ``with press(model):
  model.generate(...)`` does in kvpress.
* **perplexity**: ``windows`` windows of 2,048 corpus tokens (default 4, not 8: each window costs 19 teacher-forced
  512-token passes, ~1.5 min on 2 shared cores; pass ``windows=8`` for the full protocol); prefill
  ``[0, 1536)``; compress (or select); teacher-forced perplexity of ``[1536, 2048)``;
  ``dppl_rel`` = ppl / ppl(full) - 1.

kvshelf side: one eager prefill per case is scored by every static method at once (``adapters.pruning.scoring``:
the prefill's computation does not depend on the pruning, as each layer is pruned after it ran), then each
method's pruned cache decodes greedily (sdpa). TokenSelect keeps the full cache and attends to its selection.
kvpress side: its ``SnapKVPress`` and ``StreamingLLMPress`` in a virtualenv of its own (``.venv-kvpress``,
created on first use: kvpress pins an older transformers, 5.2, than kvshelf's), on the same model weights, token
ids and decode loop; one prefill per case too, each press's own ``compress`` (what its forward hook calls) run on
every layer. ``kv_bytes``: the largest cache (keys + values, fp32) after decoding;
``decode_tok_s``: decode tokens / decode seconds (first token excluded: it comes from the full prefill).
Timings on a shared CPU are noisy.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from bench.common import REPO_ROOT, corpus_texts, machine_description, save_results

BUDGETS = (0.5, 0.25, 0.125)
STATIC = ("streamingllm", "h2o", "keyformer", "snapkv", "keynorm")
QUESTION = "\n\nQuestion: What is the secret code mentioned in the text above?\nAnswer: The secret code is"
KVPRESS_VENV = REPO_ROOT / ".venv-kvpress"
KVPRESS_REQUIREMENTS = ("torch==2.13.0", "kvpress")


def needle_cases(tokenizer: Any, texts: list[str], count: int, tokens: int = 1300, seed: int = 0) -> list[dict]:
    """``count`` prompts of ~``tokens`` tokens: abstracts with a planted 4-digit code, then the question."""
    rng = random.Random(seed)
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    cases = []
    for i in range(count):
        code = f"{rng.randint(1000, 9999)}"
        docs, length, j = [], 0, i * 7
        while length < tokens - len(question) - 20:
            doc = texts[j % len(texts)]
            docs.append(doc)
            length += len(tokenizer(doc + "\n\n", add_special_tokens=False)["input_ids"])
            j += 1
        docs.insert(rng.randint(0, len(docs)), f"The secret code is {code}.")
        ids = tokenizer("\n\n".join(docs), add_special_tokens=False)["input_ids"][: tokens - len(question)]
        if code not in tokenizer.decode(ids):  # the cut fell inside the needle: put it near the start
            ids = tokenizer(f"The secret code is {code}.\n\n", add_special_tokens=False)["input_ids"] + ids
            ids = ids[: tokens - len(question)]
        cases.append({"ids": ids + question, "code": code})
    return cases


def ppl_windows(tokenizer: Any, texts: list[str], count: int, length: int = 2048) -> list[list[int]]:
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= count * length:
            break
    return [ids[i * length:(i + 1) * length] for i in range(len(ids) // length)][:count]


def _clone(cache: Any) -> Any:
    from adapters.pruning import prune_cache

    full = {i: torch.arange(layer.keys.shape[2]).expand(*layer.keys.shape[:2], -1)
            for i, layer in enumerate(cache.layers)}
    return prune_cache(cache, full)


def _kv_bytes(cache: Any) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@torch.inference_mode()
def _decode(model: Any, cache: Any, first: int, position: int, steps: int) -> tuple[list[int], float]:
    """Greedy decode ``steps`` tokens after ``first`` (at absolute ``position``); returns (tokens, seconds)."""
    out, token = [first], first
    start = time.perf_counter()
    for step in range(steps):
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                       position_ids=torch.tensor([[position + step]])).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
    return out, time.perf_counter() - start


@torch.inference_mode()
def _chunk_nll(model: Any, cache: Any, ids: list[int], start: int, first_logits: torch.Tensor) -> float:
    """Mean NLL of ``ids[start:]`` given ``cache`` (of ``ids[:start]``), teacher-forced in one forward."""
    rest = torch.tensor([ids[start:-1]])
    logits = model(input_ids=rest, past_key_values=cache, use_cache=True,
                   position_ids=torch.arange(start, len(ids) - 1).unsqueeze(0)).logits[0]
    logits = torch.cat([first_logits.unsqueeze(0), logits]).float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[start:])))


def _methods(budgets: tuple[float, ...]) -> dict[str, Any]:
    from adapters.pruning import H2O, Keyformer, KeyNorm, SnapKV, StreamingLLM

    makers = {"streamingllm": StreamingLLM, "h2o": H2O, "keyformer": Keyformer, "snapkv": SnapKV,
              "keynorm": lambda budget: KeyNorm(budget, recent=32)}
    return {f"{name}@{b}": makers[name](budget=b) for name in STATIC for b in budgets}


def _prefill(model: Any, ids: list[int], methods: dict[str, Any]) -> tuple[Any, torch.Tensor, dict]:
    from transformers import DynamicCache

    from adapters.pruning import scoring

    model.set_attn_implementation("eager")
    cache = DynamicCache()
    with torch.inference_mode(), scoring(model, methods) as kept:
        logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
    model.set_attn_implementation("sdpa")
    return cache, logits, kept


def run_kvshelf(model: Any, cases: list[dict], windows: list[list[int]], budgets: tuple[float, ...],
                new_tokens: int, prefill: int) -> dict[tuple[str, float], dict]:
    from adapters.pruning import TokenSelect, prune_cache

    methods = _methods(budgets)
    configs = [("full", 1.0)] + [(n, b) for n in STATIC for b in budgets] + [("tokenselect", b) for b in budgets]
    acc: dict[tuple[str, float], dict] = {c: {"outputs": [], "secs": 0.0, "steps": 0, "kv": 0, "nll": []}
                                          for c in configs}
    for case in tqdm(cases, desc="kvshelf needle", unit="case"):
        ids = case["ids"]
        cache, logits, kept = _prefill(model, ids, methods)
        first = int(logits.argmax())
        for name, budget in configs:
            if name == "full" or name == "tokenselect":
                c = _clone(cache)
                if name == "tokenselect":
                    with TokenSelect(budget)(model):
                        out, secs = _decode(model, c, first, len(ids), new_tokens - 1)
                else:
                    out, secs = _decode(model, c, first, len(ids), new_tokens - 1)
            else:
                c = prune_cache(cache, kept[f"{name}@{budget}"])
                out, secs = _decode(model, c, first, len(ids), new_tokens - 1)
            r = acc[(name, budget)]
            r["outputs"].append(out)
            r["secs"] += secs
            r["steps"] += new_tokens - 1
            r["kv"] = max(r["kv"], _kv_bytes(c))
    for ids in tqdm(windows, desc="kvshelf perplexity", unit="window"):
        cache, logits, kept = _prefill(model, ids[:prefill], methods)
        for name, budget in configs:
            if name == "tokenselect":
                with TokenSelect(budget)(model):
                    nll = _chunk_nll(model, _clone(cache), ids, prefill, logits)
            elif name == "full":
                nll = _chunk_nll(model, _clone(cache), ids, prefill, logits)
            else:
                nll = _chunk_nll(model, prune_cache(cache, kept[f"{name}@{budget}"]), ids, prefill, logits)
            acc[(name, budget)]["nll"].append(nll)
    return acc


KVPRESS_WORKER = r'''
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from kvpress import SnapKVPress, StreamingLLMPress
spec = json.load(open(sys.argv[1]))
torch.set_num_threads(spec["threads"])
model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
presses = {(name, b): cls(compression_ratio=1.0 - b) for name, cls in (("snapkv", SnapKVPress),
           ("streamingllm", StreamingLLMPress)) for b in spec["budgets"]}
modules = [layer.self_attn for layer in model.model.layers]


def prefill(ids):
    # one prefill for every press: each press's own `compress` (what its forward hook calls) on each layer
    compressed = {key: [] for key in presses}

    def hook(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        for key, press in presses.items():
            compressed[key].append(press.compress(module, kwargs["hidden_states"], layer.keys, layer.values,
                                                  output[1], kwargs))
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        logits = model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True).logits
    finally:
        for h in handles:
            h.remove()
    caches = {}
    for key, layers in compressed.items():
        cache = DynamicCache()
        for i, (k, v) in enumerate(layers):
            cache.update(k, v, i)
        caches[key] = cache
    return logits[0, -1], caches


def step(ids, cache, start):
    pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    length = cache.get_seq_length()
    return model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=pos,
                 cache_position=torch.arange(length, length + ids.shape[1])).logits


results = {key: {"method": key[0], "budget": key[1], "outputs": [], "secs": 0.0, "steps": 0, "kv": 0, "nll": []}
           for key in presses}
with torch.inference_mode():
    for n, ids in enumerate(spec["cases"]):
        last, caches = prefill(ids)
        first = int(last.argmax())
        for key, cache in caches.items():
            r, token, out = results[key], first, [first]
            t0 = time.perf_counter()
            for s in range(spec["new_tokens"] - 1):
                token = int(step(torch.tensor([[token]]), cache, len(ids) + s)[0, -1].argmax())
                out.append(token)
            r["secs"] += time.perf_counter() - t0
            r["steps"] += spec["new_tokens"] - 1
            r["outputs"].append(out)
            r["kv"] = max(r["kv"], sum(int(lay.keys.nbytes + lay.values.nbytes) for lay in cache.layers))
        print(f"kvpress case {n + 1}/{len(spec['cases'])}", flush=True)
    p = spec["prefill"]
    for ids in spec["windows"]:
        last, caches = prefill(ids[:p])
        for key, cache in caches.items():
            logits = torch.cat([last.unsqueeze(0), step(torch.tensor([ids[p:-1]]), cache, p)[0]]).float()
            results[key]["nll"].append(float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[p:]))))
json.dump({"results": list(results.values())}, open(spec["out"], "w"))
'''


def ensure_kvpress_venv(console: Console) -> tuple[Path | None, str | None]:
    """The kvpress virtualenv's python (created on first use), or ``(None, reason)``."""
    python = KVPRESS_VENV / "bin" / "python"
    check = [str(python), "-c", "import kvpress, transformers; print(transformers.__version__)"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, None
    console.print(f"[dim]creating {KVPRESS_VENV} (kvpress pins an older transformers)...[/dim]")
    steps = [[sys.executable, "-m", "venv", str(KVPRESS_VENV)],
             [str(python), "-m", "pip", "install", "-q", KVPRESS_REQUIREMENTS[0]],
             [str(python), "-m", "pip", "install", "-q", KVPRESS_REQUIREMENTS[1]]]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return None, f"`{' '.join(cmd[-3:])}` failed: {(done.stderr or done.stdout).strip()[-400:]}"
    return python, None


def run_kvpress(console: Console, model_dir: str, cases: list[dict], windows: list[list[int]],
                budgets: tuple[float, ...], new_tokens: int, prefill: int) -> tuple[dict, str]:
    """kvpress results keyed like ``run_kvshelf``'s, and a note (its transformers version, or why it failed)."""
    python, reason = ensure_kvpress_venv(console)
    if python is None:
        return {}, f"kvpress not run: {reason}"
    version = subprocess.run([str(python), "-c", "import kvpress, transformers, importlib.metadata as m; "
                              "print(m.version('kvpress'), transformers.__version__)"],
                             capture_output=True, text=True).stdout.split()
    with tempfile.TemporaryDirectory(prefix="kvshelf-kvpress-") as tmp:
        spec, out, worker = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "worker.py"
        worker.write_text(KVPRESS_WORKER)
        spec.write_text(json.dumps({"model": model_dir, "cases": [c["ids"] for c in cases], "windows": windows,
                                    "budgets": list(budgets), "new_tokens": new_tokens, "prefill": prefill,
                                    "out": str(out), "threads": torch.get_num_threads()}))
        console.print("[dim]kvpress anchor in its own virtualenv...[/dim]")
        done = subprocess.run([str(python), str(worker), str(spec)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": ""})
        if done.returncode != 0 or not out.exists():
            return {}, f"kvpress failed to run: {done.stderr.strip()[-600:]}"
        raw = json.loads(out.read_text())["results"]
    note = f"kvpress {version[0]} on transformers {version[1]} (pinned older release; kvshelf uses the current one)"
    return {(r["method"], r["budget"]): r for r in raw}, note


def _row(method: str, impl: str, budget: float, r: dict, cases: list[dict], tokenizer: Any,
         full_ppl: float | None) -> dict[str, Any]:
    correct = [c["code"] in tokenizer.decode(out) for c, out in zip(cases, r["outputs"], strict=True)]
    ppl = float(torch.tensor(r["nll"]).mean().exp()) if r["nll"] else float("nan")
    return {
        "method": method, "impl": impl, "budget": budget,
        "accuracy": round(sum(correct) / len(correct), 4),
        "dppl_rel": round(ppl / full_ppl - 1.0, 4) if full_ppl else 0.0,
        "ppl": round(ppl, 4),
        "kv_bytes": int(r["kv"]),
        "decode_tok_s": round(r["steps"] / r["secs"], 2) if r["secs"] else 0.0,
        "cases": len(correct), "windows": len(r["nll"]),
        "correct": correct,
    }


def run(
    *,
    json_path: str | None,
    corpus: str | None,
    cases: int = 40,
    windows: int = 4,
    budgets: tuple[float, ...] = BUDGETS,
    new_tokens: int = 6,
    model_name: str = "smollm2-135m",
    kvpress: bool = True,
    console: Console | None = None,
) -> dict[str, Any]:
    from adapters.model import convert_bundled, load_model

    console = console or Console()
    started = time.perf_counter()
    model, tokenizer = load_model(model_name)
    texts = list(corpus_texts(corpus))
    needle = needle_cases(tokenizer, texts, cases)
    wins = ppl_windows(tokenizer, texts, windows)
    prefill = 1536
    ours = run_kvshelf(model, needle, wins, budgets, new_tokens, prefill)
    full_ppl = float(torch.tensor(ours[("full", 1.0)]["nll"]).mean().exp())
    results = [_row(m, "kvshelf", b, r, needle, tokenizer, full_ppl) for (m, b), r in ours.items()]
    note = "kvpress anchor disabled"
    if kvpress:
        theirs, note = run_kvpress(console, str(convert_bundled(model_name)), needle, wins, budgets, new_tokens,
                                   prefill)
        results += [_row(m, "kvpress", b, r, needle, tokenizer, full_ppl) for (m, b), r in theirs.items()]
    payload = {
        "model": model_name, "machine": machine_description(), "corpus": corpus or "synthetic (no corpus found)",
        "needle_tokens": len(needle[0]["ids"]), "ppl_window": 2048, "ppl_prefill": prefill,
        "new_tokens": new_tokens, "kvpress": note, "runtime_s": round(time.perf_counter() - started, 1),
        "note": "decode timings on a shared 2-core CPU are noisy; peak KV bytes are fp32",
        "results": results,
    }
    _print_table(console, payload)
    save_results(json_path, payload, console)
    return payload


def _print_table(console: Console, payload: dict[str, Any]) -> None:
    table = Table(title=f"Token pruning, {payload['model']}, needle ~{payload['needle_tokens']} tokens, "
                        f"ppl windows of {payload['ppl_window']} ({payload['machine']})", caption=payload["kvpress"])
    for column in ("method", "impl", "budget", "needle acc", "Δppl rel", "peak KV MiB", "decode tok/s", "cases"):
        table.add_column(column, justify="right")
    for r in payload["results"]:
        table.add_row(r["method"], r["impl"], f"{r['budget']:.3f}", f"{r['accuracy']:.3f}", f"{r['dppl_rel']:+.4f}",
                      f"{r['kv_bytes'] / 2**20:.1f}", f"{r['decode_tok_s']:.1f}", str(r["cases"]))
    console.print(table)


if __name__ == "__main__":
    raise SystemExit("run this benchmark with `kvshelf bench pruning`")
