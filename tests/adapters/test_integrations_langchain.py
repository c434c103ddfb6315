"""The LangChain chat model (``adapters/integrations/langchain.py``) in a real LCEL chain with a BM25 retriever
over the corpus: answers equal ``RAGGenerator``'s for the same chunks, reuse changes nothing, streaming yields the
same text, no documents is plain ``model.generate``, long documents are split as ``precompute`` splits them."""

from __future__ import annotations

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from rag_frameworks import SEPARATOR, SYSTEM, Bm25, plain_answer, rag_answer, split_prompt, tiny_with_smollm2_tokenizer

from kvshelf.adapters.integrations.core import RAGChat
from kvshelf.adapters.integrations.langchain import KVShelfChatModel, format_documents
from kvshelf.adapters.rag import RAGGenerator, precompute
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
QUESTION = "Which method improves video generation?"
NEW = 8


class Bm25Retriever(BaseRetriever):
    """A LangChain retriever over ``rag_frameworks.Bm25``."""

    index: Bm25
    k: int = 3
    model_config = {"arbitrary_types_allowed": True}

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=t) for t in self.index.top(query, self.k)]


@pytest.fixture(scope="module")
def setup(texts):
    model, tokenizer = tiny_with_smollm2_tokenizer()
    return model, tokenizer, Bm25Retriever(index=Bm25([t[:400] for t in texts]))


def prompt() -> ChatPromptTemplate:
    return ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{context}{question}")])


def chain(retriever, llm):
    return {"context": retriever | format_documents, "question": RunnablePassthrough()} | prompt() | llm \
        | StrOutputParser()


def test_chain_answer_equals_rag_generator_and_reuse_changes_nothing(setup, tmp_path):
    model, tokenizer, retriever = setup
    store = open_embedded_store(tmp_path)
    llm = KVShelfChatModel(rag=RAGChat(model, tokenizer, store, max_new_tokens=NEW))
    docs = [d.page_content for d in retriever.invoke(QUESTION)]
    expected = rag_answer(model, tokenizer, docs, QUESTION, max_new_tokens=NEW)
    assert expected.computed_chunks == 3 and expected.new_ids
    first = (prompt() | llm).invoke({"context": format_documents(docs), "question": QUESTION})
    assert first.content == expected.text
    assert first.response_metadata["computed_chunks"] == 3 and first.response_metadata["mode"] == "reuse-blend"
    second = chain(retriever, llm).invoke(QUESTION)  # the documents' KV now comes from the store
    assert second == expected.text
    again = llm.invoke(prompt().format_messages(context=format_documents(docs), question=QUESTION))
    assert again.response_metadata["reused_chunks"] == 3 and again.response_metadata["computed_chunks"] == 0
    # documents given to invoke go to the head of the last user message: the same prompt
    direct = llm.invoke([("system", SYSTEM), ("human", QUESTION)], documents=[Document(page_content=d) for d in docs])
    assert direct.content == expected.text


def test_mode_is_the_users_choice(setup):
    model, tokenizer, retriever = setup
    docs = [d.page_content for d in retriever.invoke(QUESTION)]
    llm = KVShelfChatModel(rag=RAGChat(model, tokenizer, mode="full", max_new_tokens=NEW))
    out = llm.invoke([("system", SYSTEM), ("human", QUESTION)], documents=docs)
    assert out.response_metadata["mode"] == "full"
    assert out.content == rag_answer(model, tokenizer, docs, QUESTION, mode="full", max_new_tokens=NEW).text
    other = llm.invoke([("system", SYSTEM), ("human", QUESTION)], documents=docs, mode="reuse")
    assert other.response_metadata["mode"] == "reuse"


def test_stream_yields_the_invoke_text(setup, tmp_path):
    model, tokenizer, retriever = setup
    llm = KVShelfChatModel(rag=RAGChat(model, tokenizer, open_embedded_store(tmp_path), max_new_tokens=NEW))
    pieces = list(chain(retriever, llm).stream(QUESTION))
    assert len(pieces) > 1
    assert "".join(pieces) == chain(retriever, llm).invoke(QUESTION)


def test_stop_strings_cut_the_answer_streamed_or_not(setup):
    model, tokenizer, retriever = setup
    llm = KVShelfChatModel(rag=RAGChat(model, tokenizer, max_new_tokens=NEW))
    docs = [d.page_content for d in retriever.invoke(QUESTION)]
    messages = [("system", SYSTEM), ("human", QUESTION)]
    whole = llm.invoke(messages, documents=docs).content
    cut = len(whole) // 2
    stop = whole[cut:cut + 4]  # a stop string that spans stream pieces
    assert len(stop) == 4 and whole.index(stop) <= cut
    expected = whole[:whole.index(stop)]
    assert llm.invoke(messages, documents=docs, stop=[stop]).content == expected
    assert "".join(c.content for c in llm.stream(messages, documents=docs, stop=[stop])) == expected
    assert "".join(c.content for c in llm.stream(messages, documents=docs, stop=["\x00never"])) == whole


def test_no_documents_is_plain_generate(setup):
    model, tokenizer, _ = setup
    llm = KVShelfChatModel(rag=RAGChat(model, tokenizer, max_new_tokens=NEW))
    out = llm.invoke(prompt().format_messages(context=format_documents([]), question=QUESTION))
    assert out.response_metadata["mode"] == "plain" and out.response_metadata["chunks"] == 0
    assert out.content == plain_answer(model, tokenizer, QUESTION, max_new_tokens=NEW)
    assert "".join(c.content for c in llm.stream([("system", SYSTEM), ("human", QUESTION)])) == out.content


def test_long_documents_are_split_as_precompute_splits_them(setup, texts, tmp_path):
    model, tokenizer, _ = setup
    store = open_embedded_store(tmp_path)
    docs = [texts[0], texts[1]]  # whole abstracts: several 48-token chunks each
    before, _ = split_prompt(tokenizer, QUESTION)
    done = precompute([d + SEPARATOR for d in docs], model, tokenizer, store, prefix=before, chunk_size=48,
                      modes=["reuse-blend"], progress=False)
    assert len(done.chunks) > 4
    # on_missing="error": every piece must be found under precompute's keys
    llm = KVShelfChatModel(rag=RAGChat(model, tokenizer, store, chunk_size=48, on_missing="error",
                                       max_new_tokens=NEW))
    out = llm.invoke([("system", SYSTEM), ("human", QUESTION)], documents=docs)
    meta = out.response_metadata
    assert meta["chunks"] == len(done.chunks) and meta["reused_chunks"] == len(done.chunks)
    gen = RAGGenerator(model, tokenizer, store, prefix=before, chunk_size=48)
    assert out.content == gen.generate(done.chunks, split_prompt(tokenizer, QUESTION)[1], mode="reuse-blend",
                                       max_new_tokens=NEW).text


def test_bad_inputs_are_clear_errors(setup):
    model, tokenizer, _ = setup
    with pytest.raises(ConfigError, match="unknown mode"):
        RAGChat(model, tokenizer, mode="fastest")
    llm = KVShelfChatModel(rag=RAGChat(model, tokenizer, max_new_tokens=NEW))
    marked = format_documents(["one", "two"])
    with pytest.raises(ConfigError, match="not side by side"):
        llm.invoke([HumanMessage(marked[:5] + " between " + marked[5:])])
    with pytest.raises(ConfigError, match="do not pair up"):
        llm.invoke([HumanMessage(marked[:-1] + " Q?")])
    with pytest.raises(ConfigError, match="one way"):
        llm.invoke([HumanMessage(marked + "Q?")], documents=["three"])
    with pytest.raises(ConfigError, match="not a Document"):
        llm.invoke([HumanMessage("Q?")], documents=[3])
    with pytest.raises(ConfigError, match="document 0 is empty"):
        llm.invoke([HumanMessage("Q?")], documents=["  "])
    with pytest.raises(ConfigError, match="'tool' message"):
        llm.invoke([HumanMessage("Q?"), ToolMessage("x", tool_call_id="1")])
    with pytest.raises(ConfigError, match="user message"):
        llm.invoke([("system", SYSTEM)], documents=["one"])
