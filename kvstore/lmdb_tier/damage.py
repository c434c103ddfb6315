"""Judging the file before LMDB maps it: LMDB trusts its file (a file cut short is a SIGBUS, a garbage leaf an
assertion abort), so the meta pages, the file size and every branch and leaf page are read with plain reads first
(``kvstore.lmdb_tier.file``); a damaged environment raises ``TierDamagedError`` naming the recovery.
"""

from __future__ import annotations

import time
from pathlib import Path

import lmdb

from kvshelf.kvstore.errors import ConfigError, TierDamagedError
from kvshelf.kvstore.lmdb_tier.file import check_file, verify_tree


def recovery_hint(path: Path) -> str:
    """How to recover from a damaged environment at ``path`` (the ``lmdb`` folder of a data directory)."""
    return (f"recover with `kvshelf repair --data-dir {path.parent}` (keeps every readable block), or start "
            f"with `kvshelf serve --reset-disk` (moves it aside to {path.name}.damaged-<time>, starts empty)")


def damaged_error(path: Path, what: str) -> TierDamagedError:
    return TierDamagedError(f"LMDB environment {path} is damaged: {what}; {recovery_hint(path)}")


def check_file_fits(path: Path) -> None:
    """Raise ``TierDamagedError`` if ``path/data.mdb`` is not a file LMDB can safely open: bad meta pages, or a
    file cut short before the roots of its trees (using it would SIGBUS). Reads the file, never maps it."""
    data = path / "data.mdb"
    if not data.exists():
        return
    try:
        check = check_file(data)
        for pause in (0.02, 0.05, 0.1):  # a file being created or grown by another process this instant
            if not check.problems:
                break
            time.sleep(pause)
            check = check_file(data)
    except OSError as exc:
        raise ConfigError(f"cannot read LMDB tier file {data}: {exc}") from exc
    if check.problems:
        raise damaged_error(path, "; ".join(check.problems))


def check_trees(path: Path, env: lmdb.Environment) -> None:
    """Raise ``TierDamagedError`` if a branch or leaf page of the environment's current trees is damaged (or a
    value's overflow pages lie past the file), read from the file (never through the map) under a read
    transaction, so that no writer of another process reuses the pages being read."""
    data = path / "data.mdb"
    for _ in range(5):
        with env.begin() as txn, open(data, "rb") as f:
            check = check_file(data)
            meta = next((m for m in check.metas if m.txnid == txn.id()), None)
            if meta is None:  # the meta page of this snapshot was already rewritten by later commits
                continue
            problems = verify_tree(f.fileno(), meta)
            if problems:
                raise damaged_error(path, "; ".join(problems))
            return
