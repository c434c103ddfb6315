"""kvshelf's connector through a real ``kvshelf serve`` (``grpc://`` store): blocks stored by the engine are
served back (the server counts the hits), and a server that stalls or goes away mid-run costs recomputes, never an
answer or a hung engine."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from service_helpers import ServeProcess
from vllm_engine import BLOCK, engine, generate, report, tokens_of

from kvshelf.kvstore.keys import prefix_block_keys
from kvshelf.service.client import RemoteStore

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    served = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path_factory.mktemp("serve") / "data"))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def served_engine(server: Any, model_dir: str) -> Any:
    with engine(model_dir, {"store": f"grpc://{server.address}?timeout=10"}) as llm:
        yield llm


def _wait_held(address: str, keys: list[bytes], timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    with RemoteStore(address) as remote:
        while not all(remote.held(keys)):
            assert time.monotonic() < deadline, "the engine's blocks never reached the server"
            time.sleep(0.2)


def test_blocks_go_through_kvshelf_serve_and_come_back(served_engine: Any, server: Any, documents: dict,
                                                       reference: dict, fingerprint: str) -> None:
    cold = generate(served_engine, [documents["doc3"]])[0]
    assert tokens_of([cold]) == [reference["doc3"]] and report(cold)["saved_blocks"] == 3
    _wait_held(server.address, prefix_block_keys(fingerprint, "default", documents["doc3"], BLOCK))
    warm = generate(served_engine, [documents["doc3"]])[0]
    assert tokens_of([warm]) == [reference["doc3"]]
    assert report(warm)["loaded_tokens"] == 3 * BLOCK and report(warm)["failed_tokens"] == 0
    with RemoteStore(server.address) as remote:
        stats = remote.stats()
    assert sum(t["hits"] for t in stats["tiers"]) >= 3  # the server counted the engine's hits


def test_a_stalled_server_costs_recomputes_not_answers(served_engine: Any, server: Any, documents: dict,
                                                      reference: dict) -> None:
    """A server that stops answering (SIGSTOP): the lookups give up at the URL's timeout (10 s) and vLLM computes
    the prompts; once it answers again, the blocks come from it."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        outputs = generate(served_engine, [documents["doc3"], documents["doc1"]])  # doc3 is stored there
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert tokens_of(outputs) == [reference["doc3"], reference["doc1"]]
    assert all(report(o)["loaded_tokens"] == 0 for o in outputs)
    warm = generate(served_engine, [documents["doc3"]])[0]
    assert tokens_of([warm]) == [reference["doc3"]] and report(warm)["loaded_tokens"] == 3 * BLOCK


def test_a_server_gone_mid_run_costs_recomputes_not_answers(served_engine: Any, server: Any, documents: dict,
                                                            reference: dict) -> None:
    server.stop()
    outputs = generate(served_engine, [documents["doc3"], documents["doc1"]])  # doc3 was stored there
    assert tokens_of(outputs) == [reference["doc3"], reference["doc1"]]
    assert all(report(o)["loaded_tokens"] == 0 for o in outputs)
