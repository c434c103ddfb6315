"""Fixtures of the service tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from service_helpers import InProcessServe, free_port

from kvshelf.service.serve import ServeConfig


@pytest.fixture
def serving(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., InProcessServe]]:
    """``start(**settings)``: a ``kvshelf serve`` in a thread (loopback, a data dir of the test, /metrics on a free
    port, no grace), stopped after the test."""
    started: list[InProcessServe] = []

    def start(**settings: object) -> InProcessServe:
        config = ServeConfig.from_settings(listen="127.0.0.1:0", data_dir=str(tmp_path / "data"), memory="16MiB",
                                           max_disk="64MiB", metrics_port=free_port(), grace=0, **settings)
        running = InProcessServe(config, capsys)
        started.append(running)
        return running

    yield start
    for running in started:
        running.close()
