"""The LlamaIndex LLM and response synthesizer (``adapters/integrations/llamaindex.py``) in a real
``RetrieverQueryEngine`` with a BM25 retriever over the corpus: answers equal ``RAGGenerator``'s for the same
chunks, the stored chunks are reused, streaming yields the same text, no nodes is plain ``model.generate``, long
nodes are split."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from rag_frameworks import SYSTEM, Bm25, plain_answer, rag_answer, tiny_with_smollm2_tokenizer

from kvshelf.adapters.integrations.core import RAGChat
from kvshelf.adapters.integrations.llamaindex import KVShelfLLM, KVShelfSynthesizer
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
QUESTION = "Which method improves video generation?"
NEW = 8


class Bm25Retriever(BaseRetriever):
    """A LlamaIndex retriever over ``rag_frameworks.Bm25``."""

    def __init__(self, index: Bm25, k: int = 3) -> None:
        super().__init__()
        self.index, self.k = index, k

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=t), score=1.0) for t in self.index.top(query_bundle.query_str, self.k)]


@pytest.fixture(scope="module")
def setup(texts):
    model, tokenizer = tiny_with_smollm2_tokenizer()
    return model, tokenizer, Bm25Retriever(Bm25([t[:400] for t in texts]))


def llm(model, tokenizer, store=None, **options) -> KVShelfLLM:
    return KVShelfLLM(rag=RAGChat(model, tokenizer, store, max_new_tokens=NEW, **options), system_prompt=SYSTEM)


def test_query_engine_answer_equals_rag_generator_and_reuses(setup, tmp_path):
    model, tokenizer, retriever = setup
    kv = llm(model, tokenizer, open_embedded_store(tmp_path))
    engine = RetrieverQueryEngine(retriever=retriever, response_synthesizer=KVShelfSynthesizer(kv))
    docs = [n.node.get_content() for n in retriever.retrieve(QUESTION)]
    expected = rag_answer(model, tokenizer, docs, QUESTION, max_new_tokens=NEW)
    assert expected.new_ids
    response = engine.query(QUESTION)
    assert response.response == expected.text and len(response.source_nodes) == 3
    again = kv.complete(QUESTION, documents=docs)
    assert again.text == expected.text and again.raw["reused_chunks"] == 3 and again.raw["computed_chunks"] == 0
    chat = kv.chat([ChatMessage(role=MessageRole.SYSTEM, content=SYSTEM),
                    ChatMessage(role=MessageRole.USER, content=QUESTION)], documents=docs)
    assert chat.message.content == expected.text


def test_streaming_yields_the_same_text(setup, tmp_path):
    model, tokenizer, retriever = setup
    kv = llm(model, tokenizer, open_embedded_store(tmp_path))
    plain = RetrieverQueryEngine(retriever=retriever, response_synthesizer=KVShelfSynthesizer(kv)).query(QUESTION)
    streaming = RetrieverQueryEngine(retriever=retriever,
                                     response_synthesizer=KVShelfSynthesizer(kv, streaming=True)).query(QUESTION)
    pieces = list(streaming.response_gen)
    assert len(pieces) > 1 and "".join(pieces) == plain.response
    deltas = [r.delta for r in kv.stream_complete(QUESTION)]
    assert "".join(deltas) == kv.complete(QUESTION).text


def test_no_nodes_is_plain_generate(setup):
    model, tokenizer, _ = setup
    kv = llm(model, tokenizer)
    response = KVShelfSynthesizer(kv).synthesize(QUESTION, [])
    assert response.response == plain_answer(model, tokenizer, QUESTION, max_new_tokens=NEW)
    assert kv.complete(QUESTION).raw["mode"] == "plain"


def test_long_nodes_are_split(setup, texts):
    model, tokenizer, _ = setup
    kv = llm(model, tokenizer, chunk_size=48)
    docs = [texts[2], texts[3]]
    out = kv.complete(QUESTION, documents=docs)
    expected = rag_answer(model, tokenizer, docs, QUESTION, max_new_tokens=NEW, chunk_size=48)
    assert out.raw["chunks"] == expected.chunks > 4 and out.text == expected.text


def test_bad_inputs_are_clear_errors(setup):
    model, tokenizer, _ = setup
    with pytest.raises(ConfigError, match="needs a KVShelfLLM"):
        KVShelfSynthesizer(object())
    kv = llm(model, tokenizer)
    with pytest.raises(ConfigError, match="'tool' message"):
        kv.chat([ChatMessage(role=MessageRole.TOOL, content="x")])
    with pytest.raises(ConfigError, match="no prompt templates"):
        KVShelfSynthesizer(kv).update_prompts({"text_qa_template": "x"})
    with pytest.raises(ConfigError, match="document 1 is empty"):
        kv.complete(QUESTION, documents=["one", ""])
