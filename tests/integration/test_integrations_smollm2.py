"""The RAG framework integrations on the real SmolLM2-135M-Instruct: a LangChain chain with a BM25 retriever over
the corpus, one document carrying a planted code, answers it as ``RAGGenerator`` does (reuse-blend, the
default; and ``full``) and finds the code; without documents it is ``model.generate``'s greedy answer; LlamaIndex
and Haystack give the same answer for the same documents."""

from __future__ import annotations

import pytest
from haystack import Document as HaystackDocument
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from rag_frameworks import SYSTEM, Bm25, plain_answer, rag_answer

from kvshelf.adapters.integrations.core import RAGChat
from kvshelf.adapters.integrations.haystack import KVShelfGenerator
from kvshelf.adapters.integrations.langchain import KVShelfChatModel, format_documents
from kvshelf.adapters.integrations.llamaindex import KVShelfLLM
from kvshelf.kvstore import open_embedded_store

pytestmark = pytest.mark.slow
CODE = "7316"
#: the suite's first abstract (``bench/synthetic_abstracts.py``) is about this method: the code is planted in it
NAME = "QuantumLoop"
QUESTION = f"What is the secret code of the {NAME} paper?"
NEW = 16


class Bm25Retriever(BaseRetriever):
    index: Bm25
    k: int = 4
    model_config = {"arbitrary_types_allowed": True}

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=t) for t in self.index.top(query, self.k)]


@pytest.fixture(scope="module")
def corpus(texts) -> list[str]:
    docs = [t[:500] for t in texts]
    assert docs[0].startswith(NAME)
    docs[0] = docs[0] + f"\n\nThe secret code of the {NAME} paper is {CODE}."
    return docs


def test_langchain_chain_on_smollm2(smollm2, corpus, tmp_path):
    model, tokenizer = smollm2
    retriever = Bm25Retriever(index=Bm25(corpus))
    docs = [d.page_content for d in retriever.invoke(QUESTION)]
    assert corpus[0] in docs
    llm = KVShelfChatModel(rag=RAGChat(model, tokenizer, open_embedded_store(tmp_path), max_new_tokens=NEW))
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{context}{question}")])
    chain = {"context": retriever | format_documents, "question": RunnablePassthrough()} | prompt | llm \
        | StrOutputParser()
    answer = chain.invoke(QUESTION)
    assert answer == rag_answer(model, tokenizer, docs, QUESTION, max_new_tokens=NEW).text
    assert CODE in answer
    assert "".join(chain.stream(QUESTION)) == answer  # the second time from the stored chunks
    full = llm.invoke(prompt.format_messages(context=format_documents(docs), question=QUESTION), mode="full")
    assert full.content == rag_answer(model, tokenizer, docs, QUESTION, mode="full", max_new_tokens=NEW).text
    assert CODE in full.content
    bare = llm.invoke(prompt.format_messages(context=format_documents([]), question=QUESTION))
    assert bare.content == plain_answer(model, tokenizer, QUESTION, max_new_tokens=NEW)
    # the other two frameworks, same documents, same answer
    rag = llm.rag
    assert KVShelfLLM(rag=rag, system_prompt=SYSTEM).complete(QUESTION, documents=docs).text == answer
    out = KVShelfGenerator(rag, system_prompt=SYSTEM).run(prompt=QUESTION,
                                                          documents=[HaystackDocument(content=d) for d in docs])
    assert out["replies"] == [answer] and out["meta"][0]["reused_chunks"] == len(docs)
