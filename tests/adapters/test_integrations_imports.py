"""Each RAG framework is imported in one module only (its integration), so kvshelf without the extra still
imports, and ``import kvshelf.adapters.integrations.core`` needs none of them."""

from __future__ import annotations

import ast
import subprocess
import sys

from helpers import REPO_ROOT

#: framework top-level module -> the only files that may import it
ALLOWED = {
    "langchain_core": {"adapters/integrations/langchain.py", "bench/rag_chain.py"},
    "langchain_huggingface": {"adapters/integrations/hf_baseline.py"},
    "llama_index": {"adapters/integrations/llamaindex.py"},
    "haystack": {"adapters/integrations/haystack.py"},
}
PARTS = ("kvstore", "compress", "reuse", "adapters", "service", "proto", "bench", "kvshelf")


def _imports(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_each_framework_is_imported_only_by_its_integration() -> None:
    wrong = []
    for part in PARTS:
        for path in (REPO_ROOT / part).rglob("*.py"):
            rel = str(path.relative_to(REPO_ROOT))
            for module in _imports(path) & set(ALLOWED):
                if rel not in ALLOWED[module]:
                    wrong.append(f"{rel} imports {module}")
    assert not wrong, wrong


def test_core_loads_no_framework() -> None:
    code = ("import sys, kvshelf.adapters.integrations.core; "
            f"print(sorted(m for m in {sorted(ALLOWED)!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
