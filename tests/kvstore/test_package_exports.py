"""``kvshelf.kvstore`` loads its names on first use (as the root package does): ``__all__`` matches the lazy
exports and what type checkers see, every name resolves, and its light modules load without torch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import kvshelf.kvstore as kvstore


def test_all_matches_the_exports() -> None:
    assert len(kvstore.__all__) == len(set(kvstore.__all__)), "__all__ lists a name twice"
    assert set(kvstore.__all__) == set(kvstore._EXPORTS)
    assert set(kvstore.__all__) <= set(dir(kvstore))


def test_type_checkers_see_every_export() -> None:
    """The ``if TYPE_CHECKING:`` imports name each export, from the module ``_EXPORTS`` names."""
    tree = ast.parse(Path(kvstore.__file__).read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    seen = {alias.asname or alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    assert seen == kvstore._EXPORTS


@pytest.mark.parametrize("name", sorted(kvstore._EXPORTS))
def test_every_export_resolves(name: str) -> None:
    assert getattr(kvstore, name) is getattr(importlib.import_module(kvstore._EXPORTS[name]), name)


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="'kvshelf.kvstore' has no attribute 'nope'"):
        kvstore.nope  # noqa: B018


def test_light_modules_load_no_torch() -> None:
    """The errors, keys, limits and the store interface (what the client's admin calls use) load no torch; a block
    name still does, when asked for."""
    code = ("import sys\n"
            "import kvshelf.kvstore, kvshelf.kvstore.errors, kvshelf.kvstore.keys, kvshelf.kvstore.limits\n"
            "import kvshelf.kvstore.protocol, kvshelf.kvstore.stats\n"
            "from kvshelf.kvstore import ConfigError, KVShelfError, TierUnavailableError\n"
            "light = 'torch' in sys.modules\n"
            "from kvshelf.kvstore import KVBlock\n"
            "print(light, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["False", "True"]
