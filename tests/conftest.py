"""Shared, generic fixtures. Block helpers live in ``tests/support/helpers.py`` (importable as ``helpers``)."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import helpers
import pytest

# tests/vllm runs a real vLLM engine: only in the vLLM venv (`make test-vllm`)
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm"]

# Haystack sends usage telemetry unless told not to: the suite sends nothing off this machine.
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")


def pytest_configure(config: pytest.Config) -> None:
    """Several tests press Ctrl-C on a child process (``kvshelf events``, ``kvshelf dashboard``, an example) and
    expect it to exit. A suite started in the background by a script (``cmd &``, ``nohup``) inherits SIGINT
    ignored, and so would every child it starts (an ignored signal stays ignored across ``exec``, and Python then
    installs no KeyboardInterrupt handler): give this process Python's own handler back, which its children do not
    inherit, so they start with SIGINT at its default as from a terminal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # one of several pytest-xdist workers (`make test` runs one per core): one torch thread each, and for the
        # processes it starts; two workers of two threads each on two cores spin against each other (the model
        # tests ran up to 6x slower)
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under tests/integration/ (the real model, chaos) is ``slow``, and so are the whole benchmark runs
    in tests/bench/ (marked in their modules). Modules with a ``slow`` test run first, each module's tests together
    and in order: workers that take whole files (``--dist loadfile``) start on the long ones and end on short ones,
    so neither waits long for the other."""
    integration = Path(__file__).parent / "integration"
    for item in items:
        if integration in item.path.parents:
            item.add_marker(pytest.mark.slow)
    slow_modules = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_modules)


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


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The suite's own corpus: made-up abstracts (``kvshelf.bench.synthetic_abstracts``) in a JSONL file shaped like
    ``../shared/data/abstracts.jsonl``. Tests never read ``../shared``: a user's clone has none beside it."""
    import json

    from kvshelf.bench.synthetic_abstracts import make_abstracts

    path = tmp_path_factory.mktemp("corpus") / "abstracts.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in make_abstracts()))
    return str(path)


@pytest.fixture(scope="module")
def texts(corpus_path: str) -> list[str]:
    """Texts of the suite's corpus (``corpus_path``), each ``"title. abstract"``."""
    from kvshelf.bench.common import corpus_texts

    return list(corpus_texts(corpus_path))

