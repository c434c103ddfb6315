"""Shared, generic fixtures. Block helpers live in ``tests/support/helpers.py`` (importable as ``helpers``)."""

from __future__ import annotations

import signal
from pathlib import Path

import helpers
import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Several tests press Ctrl-C on a child process (``kvshelf events``, ``kvshelf dashboard``, an example) and
    expect it to exit. A suite started in the background by a script (``cmd &``, ``nohup``) inherits SIGINT
    ignored, and so would every child it starts (an ignored signal stays ignored across ``exec``, and Python then
    installs no KeyboardInterrupt handler): give this process Python's own handler back, which its children do not
    inherit, so they start with SIGINT at its default as from a terminal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def make_block():
    """The ``helpers.make_block`` factory: ``make_block(tokens=4, layers=2, heads=2, head_dim=8, ...)``."""
    return helpers.make_block


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A fresh, empty data directory for one test."""
    path = tmp_path / "data"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def smollm2():
    """``(model, tokenizer)`` of the real SmolLM2-135M-Instruct (fp32, CPU), loaded once per test module."""
    from kvshelf.adapters.model import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Texts of ../shared/data/abstracts.jsonl (or made-up documents when the corpus is absent)."""
    from kvshelf.bench.common import corpus_texts, default_corpus

    corpus = default_corpus()
    return list(corpus_texts(str(corpus) if corpus else None))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under tests/integration/ (the real model, chaos, whole benchmarks) is ``slow``."""
    integration = Path(__file__).parent / "integration"
    for item in items:
        if integration in item.path.parents:
            item.add_marker(pytest.mark.slow)
