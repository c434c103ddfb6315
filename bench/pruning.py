"""``kvshelf bench pruning``: token pruning and selection on SmolLM2, with NVIDIA kvpress as the anchor.

Three phases, budgets 50% / 25% / 12.5% of the prompt, every method and the kvpress anchor in each:

* **decode speed** (first, so that a cut-short run still has it): on ``speed_cases`` needle prompts, each
  method's pruned cache decodes ``speed_steps`` greedy tokens, ``speed_rounds`` timed runs per case after one
  untimed warm-up run, kvshelf and kvpress **interleaved** run by run (a kvshelf run, the kvpress run of the same
  configuration, ...; the order flips every round) so load bursts on a shared machine hit both; both processes
  use the same number of torch threads and the same decode loop (one token per forward, a fresh copy of the
  pruned cache per run, copy not timed). ``decode_tok_s`` is the median over runs; the kvshelf / kvpress SnapKV
  ratio is the median of the per-pair ratios.
* **needle QA**: ``cases`` prompts of ~1,300 tokens (corpus abstracts with one planted sentence holding a random
  4-digit code, then a question asking for it); greedy answer of ``new_tokens`` tokens; correct when the code is
  in it. The whole prompt (context + question) is prefilled and compressed, as ``with press(model):
  model.generate(...)`` does in kvpress.
* **perplexity**: ``windows`` windows of 2,048 corpus tokens (the codecs protocol: 8); prefill ``[0, 1536)``;
  compress (or select); teacher-forced perplexity of ``[1536, 2048)``; ``dppl_rel`` = ppl / ppl(full) - 1.

kvshelf side: one prefill per prompt is scored by every static method at once (``adapters.pruning.scoring``:
the prefill's computation does not depend on the pruning, as each layer is pruned after it ran), then each
method's pruned cache decodes greedily (sdpa) in ``GrowingLayer`` s, the layout ``with method(model):`` leaves
(in-place appends: no per-step ``torch.cat`` of the whole cache); the speed section also times SnapKV's pruned
cache in plain ``DynamicLayer`` s, to show what that layout buys. ``full`` and TokenSelect (which keeps the full
cache and attends to its selection) decode in plain ``DynamicLayer`` s.
kvpress side: its ``SnapKVPress`` and ``StreamingLLMPress`` in a virtualenv of its own (``venv-kvpress`` under
``$KVSHELF_CACHE``, or ``$KVSHELF_KVPRESS_VENV``, or ``kvshelf bench pruning --kvpress-venv DIR``; created on first
use: kvpress pins an older transformers, 5.2, than kvshelf's), one long-lived worker process on the same model
weights, token ids and decode loop; one prefill per prompt too, each press's own ``compress`` (what its forward
hook calls) run on every layer. Needle cases and windows alternate between the two sides, and
the JSON is rewritten after every phase step (``status`` says how far a run got). ``kv_bytes``: the largest cache
(keys + values, fp32, a ``GrowingLayer``'s headroom included) after decoding.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import IO, Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from kvshelf.adapters.pruning.layout import cache_bytes
from kvshelf.bench.common import corpus_texts, ensure_side_venv, machine_description, save_results
from kvshelf.kvstore.paths import cache_dir

BUDGETS = (0.5, 0.25, 0.125)
STATIC = ("streamingllm", "h2o", "keyformer", "snapkv", "keynorm")
KVPRESS_METHODS = ("snapkv", "streamingllm")
QUESTION = "\n\nQuestion: What is the secret code mentioned in the text above?\nAnswer: The secret code is"
KVPRESS_REQUIREMENTS = ("torch==2.13.0", "kvpress")

Config = tuple[str, float]


def key(name: str, budget: float) -> str:
    return f"{name}@{budget}"


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


#: kvshelf methods to run (``None``: all); ``full`` always runs, kvpress runs all of its presses.
Only = tuple[str, ...] | None


def _static(only: Only) -> tuple[str, ...]:
    """The static methods to run: all of ``STATIC``, or those named in ``only``."""
    return STATIC if only is None else tuple(m for m in STATIC if m in only)


def configs(budgets: tuple[float, ...], only: Only = None) -> list[Config]:
    """kvshelf's configurations: ``full``, the static methods and TokenSelect (those in ``only``) at every budget."""
    dynamic = only is None or "tokenselect" in only
    return ([("full", 1.0)] + [(n, b) for n in _static(only) for b in budgets]
            + ([("tokenselect", b) for b in budgets] if dynamic else []))


def fresh(cache: Any) -> Any:
    """A new ``DynamicCache`` over the same tensors (decoding concatenates into new ones, so no copy is needed)."""
    from kvshelf.adapters import hf

    return hf.cache_from_tensors(hf.cache_tensors(cache))


def _methods(budgets: tuple[float, ...], only: Only = None) -> dict[str, Any]:
    from kvshelf.adapters.pruning import H2O, Keyformer, KeyNorm, SnapKV, StreamingLLM

    makers = {"streamingllm": StreamingLLM, "h2o": H2O, "keyformer": Keyformer, "snapkv": SnapKV,
              "keynorm": lambda budget: KeyNorm(budget, recent=32)}
    return {key(name, b): makers[name](budget=b) for name in _static(only) for b in budgets}


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


class Prefilled:
    """One prefill of ``ids`` scored by every static method: builds each configuration's cache on demand. sdpa,
    unless a method needs eager attention weights on this model (``needs_attention_weights``: H2O and Keyformer
    recompute their attention mass from queries where the model allows)."""

    def __init__(self, model: Any, ids: list[int], methods: dict[str, Any]) -> None:
        from kvshelf.adapters import hf
        from kvshelf.adapters.pruning import scoring
        from kvshelf.adapters.pruning.base import needs_attention_weights

        eager = any(needs_attention_weights(m, model) for m in methods.values())
        with hf.attention_implementation(model, "eager" if eager else hf.attn_implementation(model)):
            self.cache = hf.new_cache()
            with torch.inference_mode(), scoring(model, methods) as kept:
                self.logits = model(input_ids=torch.tensor([ids]), past_key_values=self.cache,
                                    use_cache=True).logits[0, -1]
        self.kept, self.first, self.length = kept, int(self.logits.argmax()), len(ids)

    def cache_for(self, name: str, budget: float) -> Any:
        """A fresh cache for a configuration: the full one, or a pruned one (``GrowingLayer`` s, as in use)."""
        from kvshelf.adapters.pruning import prune_cache

        if name in ("full", "tokenselect"):
            return fresh(self.cache)
        return prune_cache(self.cache, self.kept[key(name, budget)])

    def dynamic_layer_cache(self, name: str, budget: float) -> Any:
        """The same pruned tokens in plain ``DynamicLayer`` s (``torch.cat`` per step), for the layout comparison."""
        pruned = self.cache_for(name, budget)
        return fresh(pruned)


def attending(model: Any, name: str, budget: float) -> Any:
    """The context a configuration decodes in: TokenSelect's attention, or nothing for a (pruned) static cache."""
    from kvshelf.adapters.pruning import TokenSelect

    return TokenSelect(budget)(model) if name == "tokenselect" else nullcontext()


KVPRESS_WORKER = r'''
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from kvpress import SnapKVPress, StreamingLLMPress


def reply(obj):
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


init = json.loads(sys.stdin.readline())
torch.set_num_threads(init["threads"])
model = AutoModelForCausalLM.from_pretrained(init["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
classes = {"snapkv": SnapKVPress, "streamingllm": StreamingLLMPress}
presses = {f"{name}@{b}": classes[name](compression_ratio=1.0 - b) for name in init["methods"]
           for b in init["budgets"]}
modules = [layer.self_attn for layer in model.model.layers]


def prefill(ids):
    # one prefill for every press: each press's own `compress` (what its forward hook calls) on each layer
    compressed = {k: [] for k in presses}

    def hook(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        for k, press in presses.items():
            compressed[k].append(press.compress(module, kwargs["hidden_states"], layer.keys, layer.values,
                                                output[1], kwargs))
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        logits = model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True).logits
    finally:
        for h in handles:
            h.remove()
    return logits[0, -1], {k: [(kk.contiguous(), vv.contiguous()) for kk, vv in layers]
                           for k, layers in compressed.items()}


def fresh(layers):
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def step(ids, cache, start):
    pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    length = cache.get_seq_length()
    return model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=pos,
                 cache_position=torch.arange(length, length + ids.shape[1])).logits


def decode(cache, first, position, steps):
    out, token = [first], first
    t0 = time.perf_counter()
    for s in range(steps):
        token = int(step(torch.tensor([[token]]), cache, position + s)[0, -1].argmax())
        out.append(token)
    return out, time.perf_counter() - t0


prepared = None
reply({"ready": True})
with torch.inference_mode():
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "case":
            ids = cmd["ids"]
            t0 = time.perf_counter()
            last, caches = prefill(ids)
            ttft = time.perf_counter() - t0  # one prefill for every press (each press's compress included)
            answer = {}
            for k, layers in caches.items():
                cache = fresh(layers)
                out, secs = decode(cache, int(last.argmax()), len(ids), cmd["new_tokens"] - 1)
                answer[k] = {"out": out, "kv": sum(int(l.keys.nbytes + l.values.nbytes) for l in cache.layers),
                             "ttft": ttft, "secs": secs, "kept": sum(kk.shape[-2] for kk, _ in layers) / len(layers)}
            reply(answer)
        elif op == "window":
            ids, p = cmd["ids"], cmd["prefill"]
            last, caches = prefill(ids[:p])
            answer = {}
            for k, layers in caches.items():
                logits = torch.cat([last.unsqueeze(0), step(torch.tensor([ids[p:-1]]), fresh(layers), p)[0]]).float()
                answer[k] = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[p:])))
            reply(answer)
        elif op == "window_top1":  # bench longctx: NLL and top-1 accuracy of ids[p:], with timings
            ids, p = cmd["ids"], cmd["prefill"]
            t0 = time.perf_counter()
            last, caches = prefill(ids[:p])
            ttft = time.perf_counter() - t0
            answer = {}
            for k, layers in caches.items():
                t1 = time.perf_counter()
                logits = torch.cat([last.unsqueeze(0), step(torch.tensor([ids[p:-1]]), fresh(layers), p)[0]]).float()
                secs = time.perf_counter() - t1
                target = torch.tensor(ids[p:])
                answer[k] = {"nll": float(torch.nn.functional.cross_entropy(logits, target)),
                             "top1": float((logits.argmax(-1) == target).float().mean()), "ttft": ttft, "secs": secs,
                             "kept": sum(kk.shape[-2] for kk, _ in layers) / len(layers)}
            reply(answer)
        elif op == "prepare":
            last, caches = prefill(cmd["ids"])
            prepared = (int(last.argmax()), len(cmd["ids"]), caches)
            reply({"ok": True})
        elif op == "time":
            first, position, caches = prepared
            _, secs = decode(fresh(caches[cmd["key"]]), first, position, cmd["steps"])
            reply({"secs": secs})
'''


class KvpressWorker:
    """The kvpress anchor: one long-lived process in the kvpress virtualenv, driven by JSON lines (``@@ `` replies)."""

    def __init__(self, python: Path, model_dir: str, budgets: tuple[float, ...], threads: int, tmp: Path) -> None:
        self.script, self.log = tmp / "kvpress_worker.py", tmp / "kvpress_worker.log"
        self.script.write_text(KVPRESS_WORKER)
        self._err: IO[str] = self.log.open("w")
        self.proc = subprocess.Popen([str(python), str(self.script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, env={**os.environ, "PYTHONPATH": ""})
        self._send({"model": model_dir, "budgets": list(budgets), "threads": threads,
                    "methods": list(KVPRESS_METHODS)})
        self._read()

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        self._err.flush()
        raise RuntimeError(f"kvpress worker exited: {self.log.read_text().strip()[-800:]}")

    def call(self, op: str, **kwargs: Any) -> Any:
        self._send({"op": op, **kwargs})
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._err.close()


def kvpress_venv() -> Path:
    """Where the kvpress virtualenv lives: ``$KVSHELF_KVPRESS_VENV``, else ``venv-kvpress`` under the kvshelf cache."""
    override = os.environ.get("KVSHELF_KVPRESS_VENV", "")
    return Path(override).expanduser() if override else cache_dir() / "venv-kvpress"


def ensure_kvpress_venv(console: Console, venv: Path | None = None) -> tuple[Path | None, str | None]:
    """The python of the kvpress virtualenv ``venv`` (default ``kvpress_venv()``), created on first use, or
    ``(None, reason)``."""
    return ensure_side_venv(venv or kvpress_venv(), [[KVPRESS_REQUIREMENTS[0]], [KVPRESS_REQUIREMENTS[1]]],
                            "kvpress, transformers", console, "kvpress pins an older transformers")


@contextmanager
def kvpress_worker(console: Console, enabled: bool, model_dir: str, budgets: tuple[float, ...],
                   threads: int, venv: Path | None = None) -> Iterator[tuple[KvpressWorker | None, str]]:
    """The running kvpress worker (or ``None``) and a note: its versions, or why it is not there."""
    if not enabled:
        yield None, "kvpress anchor disabled"
        return
    python, reason = ensure_kvpress_venv(console, venv)
    if python is None:
        yield None, f"kvpress not run: {reason}"
        return
    version = subprocess.run([str(python), "-c", "import kvpress, transformers, importlib.metadata as m; "
                              "print(m.version('kvpress'), transformers.__version__)"],
                             capture_output=True, text=True).stdout.split()
    note = f"kvpress {version[0]} on transformers {version[1]} (pinned older release; kvshelf uses the current one)"
    with tempfile.TemporaryDirectory(prefix="kvshelf-kvpress-") as tmp:
        console.print("[dim]kvpress anchor in its own virtualenv (one worker process)...[/dim]")
        try:
            worker = KvpressWorker(python, model_dir, budgets, threads, Path(tmp))
        except RuntimeError as exc:
            yield None, f"kvpress failed to start: {exc}"
            return
        try:
            yield worker, note
        finally:
            worker.close()


class Tally:
    """Everything measured per (impl, method, budget): outputs, peak KV bytes, NLLs, decode speed runs."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, float], dict[str, Any]] = {}
        self.snapkv_pairs: dict[float, list[float]] = {}
        self.snapkv_dynamic: dict[float, list[float]] = {}

    def of(self, impl: str, name: str, budget: float) -> dict[str, Any]:
        return self.rows.setdefault((impl, name, budget), {"outputs": [], "kv": 0, "nll": [], "tok_s": []})


def measure_speed(model: Any, worker: KvpressWorker | None, cases: list[dict], budgets: tuple[float, ...],
                  tally: Tally, steps: int, rounds: int, only: Only = None) -> None:
    """Interleaved decode timing (see the module docstring); fills ``tok_s`` and the SnapKV pair ratios."""
    methods = _methods(budgets, only)
    theirs = {(n, b) for n in KVPRESS_METHODS for b in budgets} if worker else set()
    for case in tqdm(cases, desc="decode speed", unit="case"):
        pre = Prefilled(model, case["ids"], methods)
        if worker:
            worker.call("prepare", ids=case["ids"])
        for rnd in range(rounds + 1):  # round 0 warms up (untimed)
            for name, budget in configs(budgets, only):
                order = ("kvshelf", "kvpress") if rnd % 2 == 0 else ("kvpress", "kvshelf")
                secs: dict[str, float] = {}
                for impl in order:
                    if impl == "kvpress":
                        if (name, budget) in theirs:
                            secs[impl] = worker.call("time", key=key(name, budget), steps=steps)["secs"]
                        continue
                    cache = pre.cache_for(name, budget)
                    with attending(model, name, budget):
                        secs[impl] = _decode(model, cache, pre.first, pre.length, steps)[1]
                if rnd == 0:
                    continue
                for impl, s in secs.items():
                    tally.of(impl, name, budget)["tok_s"].append(steps / s)
                if name == "snapkv" and "kvpress" in secs:
                    tally.snapkv_pairs.setdefault(budget, []).append(secs["kvpress"] / secs["kvshelf"])
            for budget in budgets:  # what the in-place layout buys: SnapKV's cache in DynamicLayers
                cache = pre.dynamic_layer_cache("snapkv", budget)
                s = _decode(model, cache, pre.first, pre.length, steps)[1]
                if rnd > 0:
                    tally.snapkv_dynamic.setdefault(budget, []).append(steps / s)


def needle_case(model: Any, worker: KvpressWorker | None, case: dict, budgets: tuple[float, ...], tally: Tally,
                new_tokens: int, only: Only = None) -> None:
    pre = Prefilled(model, case["ids"], _methods(budgets, only))
    for name, budget in configs(budgets, only):
        cache = pre.cache_for(name, budget)
        with attending(model, name, budget):
            out, _ = _decode(model, cache, pre.first, pre.length, new_tokens - 1)
        row = tally.of("kvshelf", name, budget)
        row["outputs"].append(out)
        row["kv"] = max(row["kv"], cache_bytes(cache))
    if worker:
        for k, r in worker.call("case", ids=case["ids"], new_tokens=new_tokens).items():
            name, budget = k.split("@")
            row = tally.of("kvpress", name, float(budget))
            row["outputs"].append(r["out"])
            row["kv"] = max(row["kv"], int(r["kv"]))


def ppl_window(model: Any, worker: KvpressWorker | None, ids: list[int], prefill: int, budgets: tuple[float, ...],
               tally: Tally, only: Only = None) -> None:
    pre = Prefilled(model, ids[:prefill], _methods(budgets, only))
    for name, budget in configs(budgets, only):
        with attending(model, name, budget):
            nll = _chunk_nll(model, pre.cache_for(name, budget), ids, prefill, pre.logits)
        tally.of("kvshelf", name, budget)["nll"].append(nll)
    if worker:
        for k, nll in worker.call("window", ids=ids, prefill=prefill).items():
            name, budget = k.split("@")
            tally.of("kvpress", name, float(budget))["nll"].append(nll)


def _ppl(nll: list[float]) -> float | None:
    return float(torch.tensor(nll).mean().exp()) if nll else None


def _row(impl: str, method: str, budget: float, r: dict, cases: list[dict], tokenizer: Any,
         full_ppl: float | None) -> dict[str, Any]:
    correct = [c["code"] in tokenizer.decode(out) for c, out in zip(cases, r["outputs"], strict=False)]
    ppl = _ppl(r["nll"])
    return {
        "method": method, "impl": impl, "budget": budget,
        "accuracy": round(sum(correct) / len(correct), 4) if correct else None,
        "dppl_rel": round(ppl / full_ppl - 1.0, 4) if ppl is not None and full_ppl else None,
        "ppl": round(ppl, 4) if ppl is not None else None,
        "kv_bytes": int(r["kv"]),
        "decode_tok_s": round(statistics.median(r["tok_s"]), 2) if r["tok_s"] else None,
        "decode_runs": len(r["tok_s"]),
        "cases": len(correct), "windows": len(r["nll"]),
        "correct": correct,
    }


def run(
    *,
    json_path: str | None,
    corpus: str | None,
    cases: int = 40,
    windows: int = 8,
    budgets: tuple[float, ...] = BUDGETS,
    new_tokens: int = 6,
    speed_cases: int = 2,
    speed_rounds: int = 3,
    speed_steps: int = 24,
    model_name: str = "smollm2-135m",
    kvpress: bool = True,
    kvpress_venv: str | None = None,
    methods: Only = None,
    console: Console | None = None,
) -> dict[str, Any]:
    from kvshelf.adapters.model import convert_bundled, load_model

    console = console or Console()
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kvpress worker is given the same count
    model, tokenizer = load_model(model_name)
    texts = list(corpus_texts(corpus))
    needle = needle_cases(tokenizer, texts, cases)
    wins = ppl_windows(tokenizer, texts, windows)
    prefill = 1536
    tally = Tally()

    def payload(status: str, note: str) -> dict[str, Any]:
        full = tally.rows.get(("kvshelf", "full", 1.0))
        full_ppl = _ppl(full["nll"]) if full else None
        ordered = sorted(tally.rows.items(), key=lambda kv: (kv[0][0] != "kvshelf", kv[0][1] != "full"))
        return {
            "model": model_name, "machine": machine_description(), "status": status,
            "corpus": corpus or "synthetic (no corpus found)",
            "needle_tokens": len(needle[0]["ids"]), "ppl_window": 2048, "ppl_prefill": prefill,
            "new_tokens": new_tokens, "kvpress": note, "runtime_s": round(time.perf_counter() - started, 1),
            "speed": {"cases": speed_cases, "rounds": speed_rounds, "steps": speed_steps, "threads": threads,
                      "protocol": "interleaved kvshelf/kvpress runs (order flips each round), one untimed warm-up "
                                  "round, median tok/s over runs; ratio = median of per-pair kvshelf/kvpress",
                      "snapkv_ratio": {str(b): round(statistics.median(v), 3)
                                       for b, v in tally.snapkv_pairs.items()},
                      "snapkv_dynamic_layer_tok_s": {str(b): round(statistics.median(v), 2)
                                                     for b, v in tally.snapkv_dynamic.items()}},
            "note": "peak KV bytes are fp32; decode timings on a shared 2-core CPU",
            "results": [_row(impl, m, b, r, needle, tokenizer, full_ppl) for (impl, m, b), r in ordered],
        }

    venv = Path(kvpress_venv) if kvpress_venv else None
    with kvpress_worker(console, kvpress, str(convert_bundled(model_name)), budgets, threads, venv) as (worker, note):
        measure_speed(model, worker, needle[:speed_cases], budgets, tally, speed_steps, speed_rounds, methods)
        save_results(json_path, payload("partial: decode speed done", note), console)
        for i, case in enumerate(tqdm(needle, desc="needle", unit="case"), 1):
            needle_case(model, worker, case, budgets, tally, new_tokens, methods)
            if json_path and i % 5 == 0:
                save_results(json_path, payload(f"partial: needle {i}/{len(needle)}", note), console)
        for i, ids in enumerate(tqdm(wins, desc="perplexity", unit="window"), 1):
            ppl_window(model, worker, ids, prefill, budgets, tally, methods)
            save_results(json_path, payload(f"partial: perplexity {i}/{len(wins)}", note), console)
    final = payload("complete", note)
    _print_table(console, final)
    save_results(json_path, final, console)
    return final


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_table(console: Console, payload: dict[str, Any]) -> None:
    console.print(results_table(payload))
    for budget, ratio in payload["speed"]["snapkv_ratio"].items():
        console.print(f"SnapKV decode speed at budget {budget}: kvshelf / kvpress = {ratio:.3f}x (median of pairs)")


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout; docs/benchmarks.md renders it)."""
    table = Table(title=f"Token pruning, {payload['model']}, needle ~{payload['needle_tokens']} tokens, "
                        f"ppl windows of {payload['ppl_window']} ({payload['machine']})", caption=payload["kvpress"])
    for column in ("method", "impl", "budget", "needle acc", "Δppl rel", "peak KV MiB", "decode tok/s", "cases"):
        table.add_column(column, justify="right")
    for r in payload["results"]:
        table.add_row(r["method"], r["impl"], f"{r['budget']:.3f}", _fmt(r["accuracy"], ".3f"),
                      _fmt(r["dppl_rel"], "+.4f"), f"{r['kv_bytes'] / 2**20:.1f}", _fmt(r["decode_tok_s"], ".1f"),
                      str(r["cases"]))
    return table


if __name__ == "__main__":
    raise SystemExit("run this benchmark with `kvshelf bench pruning`")
