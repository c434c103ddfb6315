"""The query-time RAG modes of ``RAGGenerator`` (``mode="full"``, ``"reuse"``, ``"reuse-blend"``,
``"block-attention"``): one class per mode behind ``base.RAGMode``, named in ``registry``."""
