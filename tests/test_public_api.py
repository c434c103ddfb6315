"""``import kvshelf`` is the public API: ``__all__`` matches the lazy exports, every name resolves, the version is
the installed distribution's, errors form one tree, and the tests run against the installed package."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvshelf

PARTS = ("kvstore", "compress", "reuse", "adapters", "service", "proto", "bench")
BARE = ("kvstore", "compress", "reuse", "adapters", "service", "bench")  # a bare ``proto`` is proto-plus's


def test_all_matches_the_exports() -> None:
    assert len(kvshelf.__all__) == len(set(kvshelf.__all__)), "__all__ lists a name twice"
    assert set(kvshelf.__all__) == {"__version__", *kvshelf._EXPORTS}
    assert dir(kvshelf) == sorted(kvshelf.__all__)
    assert set(kvshelf._RENAMED) <= set(kvshelf._EXPORTS)


@pytest.mark.parametrize("name", sorted(kvshelf._EXPORTS))
def test_every_export_resolves(name: str) -> None:
    value = getattr(kvshelf, name)
    module = importlib.import_module(kvshelf._EXPORTS[name])
    assert value is getattr(module, kvshelf._RENAMED.get(name, name))


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvshelf.nope  # noqa: B018
    assert not hasattr(kvshelf, "kvstore_") and hasattr(kvshelf, "KVShelfError")


def test_version_is_the_installed_distributions() -> None:
    assert kvshelf.__version__ == importlib.metadata.version("kvshelf")


@pytest.mark.parametrize("name", BARE)
def test_no_bare_part_name_is_importable(name: str) -> None:
    """The tests import the installed ``kvshelf`` only: no part is on ``sys.path`` under its folder's name
    (pytest runs in importlib mode with only tests/support on the path; ``python -m pytest`` from the checkout
    would put the working directory there: run ``pytest``)."""
    spec = importlib.util.find_spec(name)
    assert spec is None, f"a bare {name!r} is importable from {spec.origin or spec.submodule_search_locations}"


def test_import_kvshelf_is_light() -> None:
    """``import kvshelf`` (and the ``kvshelf`` command's start) loads neither torch, transformers nor grpc."""
    code = ("import sys, kvshelf; heavy = [m for m in ('torch', 'transformers', 'grpc', 'kvshelf.kvstore') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"


# -- errors: one tree under KVShelfError ----------------------------------------------------------------------


def _modules() -> list[str]:
    """Every module of the package (the parts are mapped packages: walk each part's own path)."""
    names = ["kvshelf"]
    for part in PARTS:
        package = importlib.import_module(f"kvshelf.{part}")
        names.append(package.__name__)
        names += [info.name for info in pkgutil.walk_packages(package.__path__, f"kvshelf.{part}.")]
    return [name for name in names if NEEDS.get(name) is None or importlib.util.find_spec(NEEDS[name]) is not None]


#: modules that import an engine installed only in its own venv (the vLLM connector: `make vllm-venv`)
NEEDS = {"kvshelf.adapters.vllm.connector": "vllm", "kvshelf.adapters.vllm.events": "vllm"}


def _nested_exception_classes(module: object) -> list[str]:
    """Classes that look like exceptions (a base named ``*Error`` / ``*Exception``) defined below module level,
    where importing the module cannot see them."""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return []
    tree = ast.parse(Path(path).read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and id(node) not in top:
            bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
            if any(b.endswith(("Error", "Exception")) for b in bases) and not node.name.startswith("_"):
                found.append(f"{module.__name__}:{node.lineno} {node.name}")
    return found


def test_every_exception_is_a_kvshelf_error_and_exported() -> None:
    defined, wrong = [], []
    for name in _modules():
        module = importlib.import_module(name)
        wrong += [f"{n}: define it at module level" for n in _nested_exception_classes(module)]
        for attr, obj in vars(module).items():
            if not (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name):
                continue
            if attr.startswith("_"):  # private control flow, never seen by a caller
                continue
            defined.append(attr)
            if not issubclass(obj, kvshelf.KVShelfError):
                wrong.append(f"{name}.{attr} does not derive from kvshelf.KVShelfError")
            if kvshelf._EXPORTS.get(attr) != name:
                wrong.append(f"{name}.{attr} is not exported by kvshelf (add it to _EXPORTS and __all__)")
    assert "KVShelfError" in defined and "UnsupportedModelError" in defined  # the walk saw the modules
    assert not wrong, "\n".join(wrong)
