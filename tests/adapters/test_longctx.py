"""Tier-backed sparse attention (``kvshelf.adapters.longctx``) through real stores, and its bad inputs.

Every test runs a tiny random-weight Llama (the architecture suite's) whose context spans many stored blocks; with
``hot_bytes=0`` no block stays in memory, so every selected block is read back from the store each step. Exactness
(every block selected) is checked against the plain model through LMDB with a lossless codec, Redis, and a
``RemoteStore`` over gRPC; a lossy codec on disk runs (decoded on fetch); each bad input is a clear error or a
counted miss, never attention over something else.
"""

from __future__ import annotations

import re

import pytest
import torch
from arch_rule import LOGIT_ATOL
from families import family_model
from redis_servers import redis_server  # noqa: F401 - a fixture

from kvshelf.adapters.longctx import (
    BlockLostError,
    LongContextError,
    ResidentBudgetError,
    TierSparse,
)
from kvshelf.kvstore import TieredStore, open_embedded_store
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.redis_tier import RedisTier
from kvshelf.kvstore.store import TierSpec
from kvshelf.reuse.errors import ContextTooLongError
from kvshelf.service.client import RemoteStore
from kvshelf.service.server import ServerLimits, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT, QUESTION, NEW = 150, 5, 4
IDS = torch.randint(3, 500, (CONTEXT + QUESTION,), generator=torch.Generator().manual_seed(5)).tolist()
EVERY = TierSparse(block_tokens=8, top_blocks=1000, sinks=4, window=16, segment=16, resident_bytes="8MiB",
                   hot_bytes=0)
FEW = TierSparse(block_tokens=8, top_blocks=2, sinks=4, window=16, segment=16, resident_bytes="8MiB", hot_bytes=0)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return family_model("llama")


def _reference(model: torch.nn.Module) -> tuple[list[int], list[torch.Tensor]]:
    t = torch.tensor([IDS])
    with torch.inference_mode():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(IDS):].tolist(), [lg[0].float() for lg in out.logits]


def _run(model: torch.nn.Module, store, method: TierSparse = EVERY):  # noqa: ANN001, ANN202
    with method.session(model, store) as session:
        session.prefill(IDS[:CONTEXT])
        scores: list[torch.Tensor] = []
        tokens = session.generate(IDS[CONTEXT:], NEW, scores=scores)
    return tokens, scores, session.stats


def _assert_exact(model: torch.nn.Module, store) -> None:  # noqa: ANN001
    tokens, scores, stats = _run(model, store)
    want_tokens, want_scores = _reference(model)
    assert tokens == want_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(scores, want_scores, strict=True)) <= LOGIT_ATOL
    assert stats.fetched_blocks > 0 and stats.hot_hits == 0  # every block came back from the store


def test_exact_through_lmdb_with_zstd(model, tmp_path) -> None:  # noqa: ANN001
    with open_embedded_store(tmp_path / "d", memory_bytes=None, disk_codec="zstd", durable=False) as store:
        _assert_exact(model, store)


def test_exact_through_redis(model, redis_server) -> None:  # noqa: ANN001, F811
    store = TieredStore([TierSpec(RedisTier.from_url(redis_server.url, prefix="longctx:"), codec="zstd")])
    try:
        _assert_exact(model, store)
    finally:
        store.close()


def test_exact_through_remote_store(model, tmp_path) -> None:  # noqa: ANN001
    backing = open_embedded_store(tmp_path / "d", memory_bytes=None, durable=False)
    running = start_server(backing, limits=ServerLimits(max_block_bytes=64 << 20))
    try:
        with RemoteStore(f"127.0.0.1:{running.port}") as remote:
            _assert_exact(model, remote)
    finally:
        running.stop(0)
        backing.close()


def test_lossy_codec_on_disk_is_decoded_on_fetch(model, tmp_path) -> None:  # noqa: ANN001
    with open_embedded_store(tmp_path / "d", memory_bytes=None, disk_codec="int8", durable=False) as store:
        tokens, scores, stats = _run(model, store, FEW)
    _, want_scores = _reference(model)
    assert len(tokens) == NEW and stats.fetched_blocks > 0
    assert float((scores[0] - want_scores[0]).abs().max()) > 0  # int8 and a selection: approximate by design


def test_selection_reads_fewer_blocks_and_memory_stays_under_the_setting(model, tmp_path) -> None:  # noqa: ANN001
    with open_embedded_store(tmp_path / "d", memory_bytes=None, durable=False) as store:
        _, _, every = _run(model, store)
    with open_embedded_store(tmp_path / "e", memory_bytes=None, durable=False) as store:
        _, _, few = _run(model, store, FEW)
    assert few.fetched_blocks < every.fetched_blocks
    assert few.kv_fraction < 1.0 == every.kv_fraction
    for stats in (every, few):
        assert 0 < stats.resident_peak_bytes <= stats.resident_limit_bytes


def test_resident_memory_does_not_grow_with_the_context(model, tmp_path) -> None:  # noqa: ANN001
    method = TierSparse(block_tokens=8, top_blocks=4, sinks=4, window=16, segment=16, resident_bytes="2MiB",
                        max_tokens=1024)
    peaks = []
    for n, path in ((200, "a"), (800, "b")):
        ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with open_embedded_store(tmp_path / path, memory_bytes=None, durable=False) as store, \
                method.session(model, store) as session:
            session.prefill(ids)
            session.generate([7, 8], 2)
        assert session.stats.resident_peak_bytes <= session.stats.resident_limit_bytes
        peaks.append((session.stats.resident_peak_bytes, session.stats.full_kv_bytes))
    (short_peak, short_kv), (long_peak, long_kv) = peaks
    assert long_kv == 4 * short_kv and long_peak / long_kv < short_peak / short_kv


def test_resident_setting_too_small_for_sinks_and_window_is_refused_before_any_work(model, tmp_path) -> None:  # noqa: ANN001
    with open_embedded_store(tmp_path / "d", memory_bytes=None, durable=False) as store:
        with pytest.raises(ResidentBudgetError, match="resident_bytes=.*sinks.*window"), \
                TierSparse(window=4096, resident_bytes="1MiB").session(model, store):
            pass
        assert store.stats()["tiers"][0]["blocks"] == 0


def test_context_longer_than_the_model_positions(model, tmp_path) -> None:  # noqa: ANN001
    with open_embedded_store(tmp_path / "d", memory_bytes=None, durable=False) as store, \
            EVERY.session(model, store) as session:
        with pytest.raises(ContextTooLongError, match="4,097 tokens .* 4,096 positions"):
            session.prefill([5] * 4097)
        assert session.stats.stored_blocks == 0
        session.prefill(IDS[:CONTEXT])
        with pytest.raises(ContextTooLongError, match="150 tokens of context, 5 of question and 4000 new"):
            session.generate(IDS[CONTEXT:], 4000)


@pytest.mark.parametrize("how", ["deleted", "damaged", "foreign"])
def test_a_block_lost_mid_generation_fails_the_call(model, tmp_path, how: str) -> None:  # noqa: ANN001
    with open_embedded_store(tmp_path / "d", memory_bytes=None, durable=False) as store, \
            EVERY.session(model, store) as session:
        session.prefill(IDS[:CONTEXT])
        key = session._layer_key(0, 3)
        lmdb = store.specs[-1].tier
        if how == "deleted":
            assert store.delete([key]) == 1
        elif how == "damaged":
            raw = lmdb.get_many([key])[0]
            lmdb.put_many([(key, raw[:-7] + b"garbage")])
        else:  # another model's block under the key
            block = store.get_many([key], fingerprint=session.fingerprint)[0]
            other = KVBlock(keys=block.keys, values=block.values, token_ids=block.token_ids,
                            start_pos=block.start_pos, fingerprint="another-model", namespace=block.namespace)
            store.put_many([(key, other)])
        with pytest.raises(BlockLostError, match=r"block 3 \(tokens 28\.\.36\) of layer 0"):
            session.generate(IDS[CONTEXT:], NEW)
        if how == "foreign":
            assert store.stats()["tiers"][0]["foreign"] >= 1
        if how == "damaged":
            assert store.stats()["tiers"][0]["corrupt"] >= 1


def test_settings_and_call_order_errors(model, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ResidentBudgetError, match="block_tokens must be > 0"):
        TierSparse(block_tokens=0)
    with pytest.raises(ConfigError, match="resident_bytes"):
        TierSparse(resident_bytes="lots")
    with open_embedded_store(tmp_path / "d", memory_bytes=None, durable=False) as store, \
            EVERY.session(model, store) as session:
        with pytest.raises(LongContextError, match="prefill a context first"):
            session.generate([1], 2)
        session.prefill(IDS[:40])
        with pytest.raises(LongContextError, match="already holds a context"):
            session.prefill(IDS[:40])


def test_a_second_session_on_the_same_context_finds_its_blocks(model, tmp_path) -> None:  # noqa: ANN001
    """Keys are content-addressed (model, namespace, settings, tokens): the same context and settings name the same
    blocks; another namespace names others."""
    with open_embedded_store(tmp_path / "d", memory_bytes=None, durable=False) as store:
        keys = []
        for namespace in ("a", "a", "b"):
            with EVERY.session(model, store, namespace=namespace) as session:
                session.prefill(IDS[:CONTEXT])
                keys.append(session._layer_key(1, 5))
        assert keys[0] == keys[1] != keys[2]


# -- several questions of one prefilled context: mark / rewind, top_blocks per question ----------------------------

# two questions long enough to move blocks past the mark to the store (the second reuses the first's block indices)
Q1 = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(9)).tolist()
Q2 = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(10)).tolist()


def _fresh(model: torch.nn.Module, store, method: TierSparse, question: list[int]):  # noqa: ANN001, ANN202
    with method.session(model, store, namespace="fresh") as session:
        session.prefill(IDS[:CONTEXT])
        scores: list[torch.Tensor] = []
        return session.generate(question, NEW, scores=scores), scores


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding layers keep their own (copied) cache
@pytest.mark.parametrize("hot", [0, None], ids=["store-only", "hot-blocks"])
def test_rewind_answers_another_question_as_a_fresh_prefill_would(family, hot, tmp_path) -> None:  # noqa: ANN001
    model = family_model(family)
    method = TierSparse(block_tokens=8, top_blocks=3, sinks=4, window=16, segment=16, resident_bytes="8MiB",
                        hot_bytes=hot)
    with open_embedded_store(tmp_path / "d", memory_bytes=None, durable=False) as store:
        with method.session(model, store) as session:
            session.prefill(IDS[:CONTEXT])
            session.mark()
            stored = session.stats.stored_blocks
            session.generate(Q1, NEW)
            assert session.stats.stored_blocks > stored  # the first question moved blocks past the mark to the store
            session.rewind()
            scores: list[torch.Tensor] = []
            tokens = session.generate(Q2, NEW, scores=scores)
            assert session.stats.resident_peak_bytes <= session.stats.resident_limit_bytes
            session.rewind()  # the mark stays: a third question
            again = session.generate(Q2, NEW)
        want_tokens, want_scores = _fresh(model, store, method, Q2)
    assert tokens == want_tokens == again
    assert max(float((a - b).abs().max()) for a, b in zip(scores, want_scores, strict=True)) <= LOGIT_ATOL


def test_top_blocks_per_question_equals_a_session_opened_with_it(model, tmp_path) -> None:  # noqa: ANN001
    with open_embedded_store(tmp_path / "d", memory_bytes=None, durable=False) as store:
        with EVERY.session(model, store) as session:
            session.prefill(IDS[:CONTEXT])
            session.mark()
            exact = session.generate(IDS[CONTEXT:], NEW)
            wide = session.stats.kv_fraction
            session.rewind()
            session.top_blocks = FEW.top_blocks
            scores: list[torch.Tensor] = []
            sparse = session.generate(IDS[CONTEXT:], NEW, scores=scores)
            assert session.stats.kv_fraction < wide
        want_tokens, want_scores = _fresh(model, store, FEW, IDS[CONTEXT:])
    assert exact == _reference(model)[0]
    assert sparse == want_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(scores, want_scores, strict=True)) <= LOGIT_ATOL


def test_mark_and_rewind_bad_calls(model, tmp_path) -> None:  # noqa: ANN001
    per_head = TierSparse(block_tokens=8, top_blocks=2, sinks=4, window=16, segment=16, resident_bytes="8MiB",
                          per_head=True)
    settings = {"block_tokens": 8, "top_blocks": 2, "sinks": 4, "window": 16, "segment": 16}
    with pytest.raises(ResidentBudgetError) as refused, TierSparse(**settings, resident_bytes=1).session(model, None):
        pass
    fixed = int(re.search(r"they need ([\d,]+) bytes", str(refused.value)).group(1).replace(",", ""))
    tight = TierSparse(**settings, resident_bytes=fixed + 1024)  # the fixed part and 1 KiB: no room for a mark
    with open_embedded_store(tmp_path / "d", memory_bytes=None, durable=False) as store:
        with FEW.session(model, store) as session:
            with pytest.raises(LongContextError, match="prefill a context before marking"):
                session.mark()
            session.prefill(IDS[:CONTEXT])
            with pytest.raises(LongContextError, match="rewind needs a mark"):
                session.rewind()
            for bad in (0, -1, True, 2.5, "3"):
                with pytest.raises(LongContextError, match="top_blocks"):
                    session.top_blocks = bad
        with per_head.session(model, store, namespace="ph") as session:
            session.prefill(IDS[:CONTEXT])
            with pytest.raises(ResidentBudgetError, match="sized for TierSparse.top_blocks=2"):
                session.top_blocks = 3
            session.top_blocks = 1
        with tight.session(model, store, namespace="tight") as session:
            session.prefill(IDS[:CONTEXT])
            with pytest.raises(ResidentBudgetError, match="a mark holds"):
                session.mark()
