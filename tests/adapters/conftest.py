"""Fixtures of the adapter tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny-model tests: they gain nothing from more, and on a shared 2-core
    machine a second thread spinning against other processes makes a suite several times slower. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
