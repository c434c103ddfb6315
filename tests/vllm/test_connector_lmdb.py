"""kvshelf's connector on a real vLLM engine over the embedded store (LMDB, no memory tier so that every read is
the disk's): a first engine stores, a second engine process reuses, and the greedy tokens always equal vLLM's
without the connector; damaged and foreign blocks cost a recompute, never an answer. Two engines serve every case
(an engine start is most of a case's time): the first, with vLLM's prefix caching on (as vLLM serves by default),
also completes a kvshelf block vLLM holds in part; the second, with a KV space of 17 pages, also preempts a request.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_engine import BLOCK, engine, generate, lmdb_dir, report, tokens_of

from kvshelf.kvstore.keys import prefix_block_keys
from kvshelf.kvstore.store_url import open_store

pytestmark = pytest.mark.slow


def _keys(fingerprint: str, tokens: list[int]) -> list[bytes]:
    return prefix_block_keys(fingerprint, "default", tokens, BLOCK)


def wait_held(url: str, keys: list[bytes], timeout_s: float = 60.0) -> None:
    """Wait until the store holds ``keys`` (the connector writes behind)."""
    deadline = time.monotonic() + timeout_s
    with open_store(url) as store:
        while not all(store.held(keys)):
            assert time.monotonic() < deadline, f"{store.held(keys)} of the blocks stored after {timeout_s} s"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"embedded://{tmp_path_factory.mktemp('vllm-store')}?memory=0"


class EventListener:
    """A ZeroMQ subscriber of the engine's KV events (vLLM's publisher), reading on a thread until ``stop``."""

    def __init__(self) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")  # vLLM's publisher connects to it
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from vllm_schema import DECODER

        while not self._stop.is_set():
            if self.sub.poll(100):
                _topic, _seq, payload = self.sub.recv_multipart()
                self.events += DECODER.decode(payload).events

    def stop(self) -> list[Any]:
        self._stop.set()
        self._thread.join()
        self.ctx.destroy(linger=0)
        return self.events


@pytest.fixture(scope="module")
def first_run(model_dir: str, documents: dict, reference: dict, fingerprint: str, store_url: str) -> dict[str, Any]:
    """A first engine with the connector and vLLM's prefix caching: every document once (stored); with vLLM's prefix
    cache emptied, doc4 again (it comes from the store); emptied again, ``straddle`` (vLLM then caches doc0's first 3
    of its 128-token pages, 384 tokens) and doc0 again (the rest of its first block and its later blocks from the
    store). Its KV events go to a subscriber (``events``)."""
    from vllm.config import KVEventsConfig

    names = ["doc0", "doc1", "doc2", "doc4", "short"]
    listener = EventListener()
    events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                   endpoint=f"tcp://127.0.0.1:{listener.port}")
    with engine(model_dir, {"store": store_url}, enable_prefix_caching=True, kv_events_config=events_config) as llm:
        outputs = dict(zip(names, generate(llm, [documents[n] for n in names]), strict=True))
        for name in ["doc4", "doc0"]:
            wait_held(store_url, _keys(fingerprint, documents[name]))
        assert llm.reset_prefix_cache()  # vLLM forgets the documents' pages; the store keeps their blocks
        again = generate(llm, [documents["doc4"]])[0]
        assert llm.reset_prefix_cache()
        straddle = generate(llm, [documents["straddle"]])[0]
        doc0_again = generate(llm, [documents["doc0"]])[0]
        time.sleep(0.5)  # the last step's events reach the subscriber
    for name in ["doc1", "doc2"]:
        wait_held(store_url, _keys(fingerprint, documents[name]))
    return {"outputs": outputs, "again": again, "straddle": straddle, "doc0_again": doc0_again,
            "events": listener.stop()}


@pytest.fixture(scope="module")
def second_engine(first_run: dict, model_dir: str, store_url: str) -> Any:
    """A new engine process over what the first stored; 17 pages of 128 tokens (one of them vLLM's null page): one
    1,000-token prompt fits, two 1,020-token prompts fit side by side but their fifth decoded tokens do not."""
    with engine(model_dir, {"store": store_url}, num_gpu_blocks_override=17, disable_log_stats=False) as llm:
        yield llm


def test_first_engine_answers_as_vllm_alone_and_stores_full_prompt_blocks(first_run: dict, reference: dict) -> None:
    for name, output in first_run["outputs"].items():
        assert tokens_of([output]) == [reference[name]], name
    assert report(first_run["outputs"]["doc0"]) == {"stored_blocks": 0, "loaded_tokens": 0, "failed_tokens": 0,
                                                    "saved_blocks": 3}
    assert report(first_run["outputs"]["short"])["saved_blocks"] == 0  # shorter than one block


def test_kv_events_name_the_stored_blocks_with_their_tier(first_run: dict, documents: dict,
                                                          fingerprint: str) -> None:
    """The connector's events reach vLLM's KV event stream beside vLLM's own: each stored block once per tier that
    stored it (``DISK``: LMDB), its hash the low 64 bits of kvshelf's key, its parent the previous block's, its
    tokens the block's."""
    stored = {e.block_hashes[0]: e for e in first_run["events"]
              if type(e).__name__ == "BlockStored" and e.medium == "DISK"}
    keys = _keys(fingerprint, documents["doc0"])
    for i, key in enumerate(keys):
        event = stored[int.from_bytes(key[-8:], "big")]
        assert event.token_ids == documents["doc0"][i * BLOCK:(i + 1) * BLOCK] and event.block_size == BLOCK
        assert event.parent_block_hash == (int.from_bytes(keys[i - 1][-8:], "big") if i else None)
    assert any(e.medium != "DISK" for e in first_run["events"])  # vLLM's own prefix-cache events beside them


def test_reuse_in_the_same_process(first_run: dict, reference: dict) -> None:
    again = first_run["again"]
    assert tokens_of([again]) == [reference["doc4"]]
    assert report(again) == {"stored_blocks": 3, "loaded_tokens": 3 * BLOCK, "failed_tokens": 0, "saved_blocks": 0}
    assert again.num_cached_tokens == 3 * BLOCK


def test_load_completes_a_block_vllm_holds_in_part(first_run: dict, reference: dict) -> None:
    """With vLLM's prefix caching on: the connector loads the pages of a kvshelf block that vLLM does not hold and
    the blocks after it, never the pages vLLM holds."""
    straddle, again = first_run["straddle"], first_run["doc0_again"]
    assert tokens_of([straddle, again]) == [reference["straddle"], reference["doc0"]]
    assert report(straddle)["loaded_tokens"] == BLOCK  # doc0's first block, from the store
    assert again.num_cached_tokens == 3 * BLOCK
    assert report(again)["loaded_tokens"] == 3 * BLOCK - 384  # block 1's last page, and block 2


def test_reuse_in_a_new_engine_process(second_engine: Any, documents: dict, reference: dict) -> None:
    output = generate(second_engine, [documents["doc0"]])[0]
    assert tokens_of([output]) == [reference["doc0"]]
    assert report(output)["loaded_tokens"] == 3 * BLOCK and report(output)["failed_tokens"] == 0
    assert output.num_cached_tokens == 3 * BLOCK


def test_partial_hit_loads_the_shared_blocks_only(second_engine: Any, documents: dict, reference: dict) -> None:
    output = generate(second_engine, [documents["partial"]])[0]  # doc0's first 600 tokens: 2 blocks stored
    assert tokens_of([output]) == [reference["partial"]]
    assert report(output)["stored_blocks"] == 2 and report(output)["loaded_tokens"] == 2 * BLOCK


def test_prompt_shorter_than_a_block(second_engine: Any, documents: dict, reference: dict) -> None:
    output = generate(second_engine, [documents["short"]])[0]
    assert tokens_of([output]) == [reference["short"]]
    assert report(output) == {"stored_blocks": 0, "loaded_tokens": 0, "failed_tokens": 0, "saved_blocks": 0}


def _tier(store_url: str) -> Any:
    from kvshelf.kvstore.tier_registry import lmdb_url, open_tier

    return open_tier(lmdb_url(lmdb_dir(Path(store_url.split("://", 1)[1].split("?")[0]))))


def test_damaged_block_is_a_counted_miss_and_recomputed(second_engine: Any, documents: dict, reference: dict,
                                                        fingerprint: str, store_url: str) -> None:
    key = _keys(fingerprint, documents["doc1"])[1]
    tier = _tier(store_url)
    try:
        (value,) = tier.get_many([key])
        assert value is not None
        damaged = bytearray(value)
        damaged[len(damaged) // 2] ^= 0xFF  # a flipped byte in the payload: the checksum no longer holds
        tier.put_many([(key, bytes(damaged))])
    finally:
        tier.close()
    output = generate(second_engine, [documents["doc1"]])[0]
    assert tokens_of([output]) == [reference["doc1"]]
    assert report(output)["stored_blocks"] == 3 and report(output)["failed_tokens"] == BLOCK


def test_foreign_block_is_a_counted_miss_and_recomputed(second_engine: Any, documents: dict, reference: dict,
                                                        fingerprint: str, store_url: str) -> None:
    own, other = _keys(fingerprint, documents["doc2"])[0], _keys(fingerprint, documents["doc0"])[0]
    tier = _tier(store_url)
    try:
        (value,) = tier.get_many([other])
        tier.put_many([(own, value)])  # a valid block, but another key's (another prompt's tokens)
    finally:
        tier.close()
    output = generate(second_engine, [documents["doc2"]])[0]
    assert tokens_of([output]) == [reference["doc2"]]
    assert report(output)["failed_tokens"] == BLOCK


def _counter(llm: Any, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def test_a_preempted_request_answers_as_vllm_alone(second_engine: Any, documents: dict, reference: dict) -> None:
    """A request preempted by vLLM (too few pages for two 1,020-token prompts to decode side by side): its pages are
    freed mid-run, it comes back through the connector's lookup (its blocks stored while it ran), and both answers
    equal vLLM's without the connector."""
    before = _counter(second_engine, "vllm:num_preemptions")
    outputs = generate(second_engine, [documents["long0"], documents["long1"]])
    assert _counter(second_engine, "vllm:num_preemptions") > before
    assert tokens_of(outputs) == [reference["long0"], reference["long1"]]
    assert all(report(o)["failed_tokens"] == 0 for o in outputs)


# -- one store for both worlds: vLLM's blocks are CachedGenerator's and back ----------------------------------


@pytest.fixture(scope="module")
def hf_generator(model_dir: str, store_url: str) -> Any:
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import load_model

    model, tokenizer = load_model(model_dir, "float32")
    with open_store(store_url) as store:
        yield CachedGenerator(model, tokenizer, store, write_behind=False)


def test_cached_generator_reuses_blocks_a_vllm_engine_stored(first_run: dict, hf_generator: Any,
                                                             documents: dict) -> None:
    alone = hf_generator.generate(documents["doc0"], max_new_tokens=8, reuse=False, store=False)
    reused = hf_generator.generate(documents["doc0"], max_new_tokens=8, store=False)
    assert reused.reused_tokens == 3 * BLOCK
    assert reused.new_ids == alone.new_ids


def test_a_vllm_engine_reuses_blocks_cached_generator_stored(second_engine: Any, hf_generator: Any,
                                                             documents: dict, reference: dict) -> None:
    stored = hf_generator.generate(documents["doc3"], max_new_tokens=1, reuse=False, wait=True)
    assert stored.stored_blocks == 3
    output = generate(second_engine, [documents["doc3"]])[0]
    assert tokens_of([output]) == [reference["doc3"]]
    assert report(output)["loaded_tokens"] == 3 * BLOCK and report(output)["failed_tokens"] == 0
