"""Shared, generic fixtures. Block helpers live in ``tests/helpers.py`` (importable as ``helpers``)."""

from __future__ import annotations

from pathlib import Path

import helpers
import pytest


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
