"""The Haystack 2 generator (``adapters/integrations/haystack.py``) in a real pipeline with Haystack's own
in-memory BM25 retriever over the corpus: answers equal ``RAGGenerator``'s for the same chunks, the stored chunks
are reused, the streaming callback gets the same text, no documents is plain ``model.generate``, long documents
are split."""

from __future__ import annotations

import pytest
from haystack import Document, Pipeline
from haystack.components.retrievers.in_memory import InMemoryBM25Retriever
from haystack.dataclasses import StreamingChunk
from haystack.document_stores.in_memory import InMemoryDocumentStore
from rag_frameworks import SYSTEM, plain_answer, rag_answer, tiny_with_smollm2_tokenizer

from kvshelf.adapters.integrations.core import RAGChat
from kvshelf.adapters.integrations.haystack import KVShelfGenerator
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
QUESTION = "Which method improves video generation?"
NEW = 8


@pytest.fixture(scope="module")
def setup(texts):
    model, tokenizer = tiny_with_smollm2_tokenizer()
    documents = InMemoryDocumentStore()
    documents.write_documents([Document(content=t[:400]) for t in texts])
    return model, tokenizer, documents


def pipeline(documents, generator) -> Pipeline:
    pipe = Pipeline()
    pipe.add_component("retriever", InMemoryBM25Retriever(document_store=documents, top_k=3))
    pipe.add_component("generator", generator)
    pipe.connect("retriever.documents", "generator.documents")
    return pipe


def test_pipeline_answer_equals_rag_generator_and_reuses(setup, tmp_path):
    model, tokenizer, documents = setup
    generator = KVShelfGenerator(RAGChat(model, tokenizer, open_embedded_store(tmp_path), max_new_tokens=NEW),
                                 system_prompt=SYSTEM)
    out = pipeline(documents, generator).run({"retriever": {"query": QUESTION}, "generator": {"prompt": QUESTION}},
                                             include_outputs_from={"retriever"})
    docs = [d.content for d in out["retriever"]["documents"]]
    expected = rag_answer(model, tokenizer, docs, QUESTION, max_new_tokens=NEW)
    assert len(docs) == 3 and expected.new_ids
    assert out["generator"]["replies"] == [expected.text]
    assert out["generator"]["meta"][0]["computed_chunks"] == 3
    again = generator.run(prompt=QUESTION, documents=out["retriever"]["documents"])
    assert again["replies"] == [expected.text] and again["meta"][0]["reused_chunks"] == 3


def test_streaming_callback_gets_the_same_text(setup, tmp_path):
    model, tokenizer, documents = setup
    chunks: list[StreamingChunk] = []
    generator = KVShelfGenerator(RAGChat(model, tokenizer, open_embedded_store(tmp_path), max_new_tokens=NEW),
                                 system_prompt=SYSTEM, streaming_callback=chunks.append)
    out = pipeline(documents, generator).run({"retriever": {"query": QUESTION}, "generator": {"prompt": QUESTION}},
                                             include_outputs_from={"retriever"})
    assert len(chunks) > 2 and chunks[0].start and chunks[-1].finish_reason == "stop"
    text = "".join(c.content for c in chunks)
    assert out["generator"]["replies"] == [text]
    plain = KVShelfGenerator(generator.rag, system_prompt=SYSTEM)
    assert plain.run(prompt=QUESTION, documents=out["retriever"]["documents"])["replies"] == [text]


def test_no_documents_is_plain_generate(setup):
    model, tokenizer, _ = setup
    generator = KVShelfGenerator(RAGChat(model, tokenizer, max_new_tokens=NEW), system_prompt=SYSTEM)
    for documents in (None, []):
        out = generator.run(prompt=QUESTION, documents=documents)
        assert out["meta"][0]["mode"] == "plain"
        assert out["replies"] == [plain_answer(model, tokenizer, QUESTION, max_new_tokens=NEW)]


def test_long_documents_are_split(setup, texts):
    model, tokenizer, _ = setup
    generator = KVShelfGenerator(RAGChat(model, tokenizer, chunk_size=48, max_new_tokens=NEW), system_prompt=SYSTEM)
    docs = [texts[4], texts[5]]
    out = generator.run(prompt=QUESTION, documents=[Document(content=d) for d in docs])
    expected = rag_answer(model, tokenizer, docs, QUESTION, max_new_tokens=NEW, chunk_size=48)
    assert out["meta"][0]["chunks"] == expected.chunks > 4 and out["replies"] == [expected.text]


def test_bad_inputs_are_clear_errors(setup):
    model, tokenizer, _ = setup
    with pytest.raises(ConfigError, match="needs a RAGChat"):
        KVShelfGenerator(object())
    generator = KVShelfGenerator(RAGChat(model, tokenizer, max_new_tokens=NEW))
    with pytest.raises(ConfigError, match="prompt is empty"):
        generator.run(prompt=" ")
    with pytest.raises(ConfigError, match="document 0 is not a Document with text"):
        generator.run(prompt=QUESTION, documents=[Document(content=None)])
    with pytest.raises(ConfigError, match="unknown mode"):
        generator.run(prompt=QUESTION, documents=[Document(content="one")], mode="fastest")
