"""Sizes a reader can hold in their head, read from the source with ``ast``: no class over ``MAX_CLASS_LINES``
lines and no function body (its docstring left out) over ``MAX_FUNCTION_LINES``, in every part but ``bench`` (whose
runs are scripts) and the generated gRPC stubs.

``STILL_TOO_LONG`` names what is over today, each to be split: a new one fails the test, and so does one that was
split but is still listed, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARTS = ("kvshelf", "kvstore", "compress", "reuse", "service", "adapters")
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60
#: ``path::name`` of what is over the limits now
STILL_TOO_LONG = {
    "adapters/generate.py::CachedGenerator",
    "adapters/longctx/session.py::SparseSession",
    "compress/cachegen.py::CacheGenCodec",
    "service/client.py::RemoteStore",
}


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        body = body[1:]
    return 0 if not body else (node.end_lineno or node.lineno) - body[0].lineno + 1


def too_long(source: str, path: str) -> dict[str, int]:
    """``path::name`` -> lines, for each class over ``MAX_CLASS_LINES`` and each function whose body is over
    ``MAX_FUNCTION_LINES`` in ``source``."""
    found = {}
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.ClassDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_CLASS_LINES:
                found[f"{path}::{node.name}"] = lines
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = _body_lines(node)
            if lines > MAX_FUNCTION_LINES:
                found[f"{path}::{node.name}"] = lines
    return found


def package_sources() -> list[Path]:
    paths = [p for part in PARTS for p in sorted((REPO / part).rglob("*.py"))]
    return [p for p in paths if "__pycache__" not in p.parts and "_pb2" not in p.name]


def test_the_scan_measures_classes_and_function_bodies() -> None:
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    doc = '    """' + "\n" * MAX_FUNCTION_LINES + '    """\n'
    source = f"def long():\n{long_body}\n\ndef documented():\n{doc}    return 1\n"
    assert too_long(source, "m.py") == {"m.py::long": MAX_FUNCTION_LINES + 1}
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(MAX_CLASS_LINES // 3 + 1))
    assert "m.py::Big" in too_long(f"class Big:\n{methods}", "m.py")


def test_no_class_or_function_is_too_long() -> None:
    assert len(package_sources()) > 100, "the scan found too few files"
    found = {}
    for path in package_sources():
        found |= too_long(path.read_text(), str(path.relative_to(REPO)))
    new = {name: lines for name, lines in found.items() if name not in STILL_TOO_LONG}
    assert not new, (f"over {MAX_CLASS_LINES} lines (classes) or {MAX_FUNCTION_LINES} (function bodies); split "
                     f"them: {new}")
    split = STILL_TOO_LONG - found.keys()
    assert not split, f"no longer too long: take them off STILL_TOO_LONG: {sorted(split)}"
