"""RAG framework integrations: a LangChain chat model (``langchain``), a LlamaIndex LLM and response synthesizer
(``llamaindex``) and a Haystack 2 generator (``haystack``), each in its own module that alone imports its framework
(``pip install "kvshelf[langchain]"``, ``[llamaindex]``, ``[haystack]``). All three answer through ``core.RAGChat``:
retrieved documents become ``RAGGenerator`` chunks (their KV stored on first sight and reused after), and a call
without documents is plain generation."""
