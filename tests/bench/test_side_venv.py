"""``bench.common.ensure_side_venv``: an anchor's own virtualenv is reused when it imports what it must, and a step
that fails is a reason, not an exception (the benchmark then runs without that anchor)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console

from kvshelf.bench.common import ensure_side_venv


def test_a_ready_venv_is_reused_without_installing(tmp_path: Path):
    (tmp_path / "bin").mkdir()
    os.symlink(sys.executable, tmp_path / "bin" / "python")
    python, reason = ensure_side_venv(tmp_path, [["no-such-package-kvshelf"]], "json", Console(quiet=True), "test")
    assert (python, reason) == (tmp_path / "bin" / "python", None)


def test_a_failing_step_is_a_reason(tmp_path: Path):
    (tmp_path / "a-file").write_text("not a directory")
    venv = tmp_path / "a-file" / "venv"  # `python -m venv` cannot create it
    python, reason = ensure_side_venv(venv, [["no-such-package-kvshelf"]], "no_such_module_kvshelf",
                                      Console(quiet=True), "test")
    assert python is None
    assert reason.startswith("`-m venv ") and "failed" in reason
