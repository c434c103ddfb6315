"""Where kvshelf writes at run time: never inside the installed package.

Everything kvshelf writes without being told where (converted models, the embedded store's default data
directory, the benchmarks' helper virtualenvs and default result files) lives under one directory:
``$KVSHELF_CACHE``, default ``~/.cache/kvshelf``. Each use may have its own override on top (for example
``KVSHELF_MODEL_CACHE``, ``KVSHELF_DATA_DIR``).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "KVSHELF_CACHE"


def cache_dir() -> Path:
    """``$KVSHELF_CACHE`` (``~`` expanded), or ``~/.cache/kvshelf``; read on every call, not created here."""
    value = os.environ.get(CACHE_ENV, "")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "kvshelf"
