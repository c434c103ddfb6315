"""Every script of examples/ runs as a user would run it (a subprocess of this interpreter, from the checkout's root)
and prints what its docstring promises. The servers the server examples need (redis-server, ``kvshelf serve`` with
examples/serve.toml) are started here on free loopback ports and stopped at teardown."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO_ROOT
from redis_servers import redis_server  # noqa: F401  (a fixture)
from service_helpers import ServeProcess

EXAMPLES = REPO_ROOT / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))
# one thread per process: on a small shared machine two OpenMP threads per process spin against each other
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_example(name: str, *args: str, timeout: float = 300) -> str:
    """``python examples/NAME ARGS`` from the checkout's root; its stdout (the test fails on a non-zero exit)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=REPO_ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def numbers(pattern: str, text: str) -> list[int]:
    return [int(n) for n in re.findall(pattern, text)]


# -- the scripts themselves -----------------------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_example_is_short_and_says_how_to_run_it(script: Path) -> None:
    source = script.read_text()
    doc = ast.get_docstring(ast.parse(source))
    assert doc and "Run" in doc and f"examples/{script.name}" in doc, f"{script.name}: no docstring saying how to run"
    assert 30 <= len(source.splitlines()) <= 120, f"{script.name}: {len(source.splitlines())} lines"
    imports = re.findall(r"^\s*(?:from|import) (kvshelf\S*)", source, re.MULTILINE)
    assert set(imports) <= {"kvshelf"}, f"{script.name} imports {imports}: examples use the public API only"


def test_readme_lists_every_example() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    for path in [*SCRIPTS, EXAMPLES / "serve.toml"]:
        assert path.name in readme, f"examples/README.md does not mention {path.name}"


# -- in process, with the SmolLM2 model -----------------------------------------------------------------------


@pytest.mark.slow
def test_document_qa_second_question_reuses_the_document() -> None:
    out = run_example("document_qa.py", "--max-new-tokens", "8")
    (document_tokens,) = numbers(r"document: (\d+) tokens", out)
    assert numbers(r"question \d: ttft=[\d.]+ ms reused=(\d+)", out) == [0, document_tokens], out
    assert "A2: " in out


@pytest.mark.slow
def test_chat_turns_reuse_the_history() -> None:
    out = run_example("chat.py", "--max-new-tokens", "8")
    reused = numbers(r"turn \d: reused=(\d+)", out)
    prefilled = numbers(r"turn \d: reused=\d+ prefilled=(\d+)", out)
    assert len(reused) == 3 and reused[0] == 0 and 0 < reused[1] < reused[2], out
    assert all(p < r for p, r in zip(prefilled[1:], reused[1:], strict=True)), out  # only the new message
    assert "the conversation holds 7 messages" in out


@pytest.mark.slow
def test_rag_pipeline_retrieves_and_reuses_precomputed_chunks(tmp_path: Path) -> None:
    out = run_example("rag_pipeline.py", "--max-new-tokens", "4")
    assert "precomputed 5 chunks of 5 documents" in out
    assert "Holloway Bikes rents" in out  # the TF-IDF retriever found the paragraph about rentals
    assert re.search(r"block-attention: .* reused_chunks=3 computed_chunks=0", out), out

    corpus = tmp_path / "corpus.jsonl"  # a corpus from files: JSONL records and a text file
    corpus.write_text("".join(json.dumps({"title": f"Note {n}", "abstract": text}) + "\n" for n, text in enumerate(
        ["Cats sleep up to sixteen hours a day.", "The Danube flows through ten countries.",
         "Basalt forms when lava cools quickly."])))
    (tmp_path / "extra.txt").write_text("Honey never spoils when it is sealed in a jar.")
    out = run_example("rag_pipeline.py", str(corpus), str(tmp_path / "extra.txt"), "--question",
                      "Which river flows through ten countries?", "--top-k", "2", "--mode", "reuse",
                      "--max-new-tokens", "4")
    assert "precomputed 4 chunks of 4 documents" in out
    assert re.search(r"retrieved document 1 chunk 0: 'Note 1\. The Danube", out), out
    assert re.search(r"reuse: .* reused_chunks=2 computed_chunks=0", out), out


@pytest.mark.slow
def test_hf_pipeline_with_an_exported_prefix() -> None:
    out = run_example("hf_pipeline.py", "--max-new-tokens", "8")
    match = re.search(r"prompt: (\d+) tokens, cached prefix: (\d+) tokens", out)
    assert match, out
    prompt_tokens, reused = int(match[1]), int(match[2])
    assert 0 < reused < prompt_tokens and reused % 64 == 0, out
    assert "same answer as without the cache: True" in out


# -- against a real kvshelf serve (and Redis) ------------------------------------------------------------------


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServeProcess]:
    """``kvshelf serve`` with examples/serve.toml, on a free port and a fresh data directory (no Redis)."""
    serve = ServeProcess("--config", str(EXAMPLES / "serve.toml"), "--listen", "127.0.0.1:0",
                         "--data-dir", str(tmp_path / "data"), "--redis", "")  # "": no Redis tier
    yield serve
    serve.stop()


@pytest.fixture
def redis_backed_server(tmp_path: Path, redis_server) -> Iterator[ServeProcess]:  # noqa: F811
    """``kvshelf serve`` with examples/serve.toml, its Redis tier on the test's redis-server (flushed first)."""
    with redis_server.client() as client:
        client.flushall()
    serve = ServeProcess("--config", str(EXAMPLES / "serve.toml"), "--listen", "127.0.0.1:0",
                         "--data-dir", str(tmp_path / "data"), "--redis", redis_server.url)
    yield serve
    serve.stop()


def test_events_subscriber_prints_stored_and_removed_events(server: ServeProcess) -> None:
    out = run_example("events_subscriber.py", server.address, "--timeout", "20", timeout=120)
    assert "put 3 blocks" in out and "deleted 1 block" in out
    assert out.count("BlockStored ") == 6, out  # 3 blocks x (memory, disk)
    assert out.count("BlockRemoved ") == 2 and "reason=deleted" in out, out
    assert "the deleted block is held in: no tier" in out and "blocks still held: 2" in out


def test_events_subscriber_watch_prints_another_clients_events_until_ctrl_c(server: ServeProcess) -> None:
    watch = subprocess.Popen([sys.executable, str(EXAMPLES / "events_subscriber.py"), server.address, "--watch"],
                             cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert watch.stdout is not None
        assert watch.stdout.readline().startswith("subscribed to namespace 'default'")
        run_example("events_subscriber.py", server.address, timeout=120)  # another client's puts and delete
        lines = [watch.stdout.readline() for _ in range(8)]
        assert sum("BlockStored " in line for line in lines) == 6, lines
        assert sum("BlockRemoved " in line for line in lines) == 2, lines
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=30) == 0, watch.stderr.read() if watch.stderr else ""
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(timeout=30)


@pytest.mark.slow
def test_shared_server_second_worker_finds_the_first_workers_blocks(redis_backed_server: ServeProcess) -> None:
    out = run_example("shared_server.py", redis_backed_server.address, "--max-new-tokens", "8")
    reused = numbers(r"worker \d: reused=(\d+)", out)
    assert len(reused) == 2 and reused[0] == 0 and reused[1] > 0, out
    (redis_blocks,) = numbers(r"server tier redis: (\d+) blocks", out)
    assert redis_blocks > 0, out
