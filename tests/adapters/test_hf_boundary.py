"""transformers stays behind one door: only ``kvshelf.adapters`` imports it, and only ``adapters/hf/`` touches
its internals (submodules, attention and cache-layer machinery, private attributes). Checked on the source (ast),
so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import REPO_ROOT

import kvshelf.adapters.hf as hf

PARTS = ("kvshelf", "kvstore", "compress", "reuse", "adapters", "service", "proto", "bench")
BOUNDARY = Path("adapters/hf")  # the package: every module in it is inside the boundary
# what only the boundary package may name: imported from transformers, or read as an attribute
INTERNAL_NAMES = {"AttentionInterface", "AttentionMaskInterface", "DynamicLayer", "DynamicSlidingWindowLayer",
                  "sdpa_attention_forward", "sdpa_mask"}
INTERNAL_ATTRIBUTES = {"_attn_implementation", "set_attn_implementation", "lazy_initialization", "is_initialized",
                       "rotary_emb", "get_decoder", "_supports_sdpa"}


def _sources() -> list[Path]:
    return sorted(p.relative_to(REPO_ROOT) for part in PARTS for p in (REPO_ROOT / part).rglob("*.py"))


def violations(path: Path, source: str) -> list[str]:
    """What ``source`` (the file at ``path``, relative to the repository) does that the boundary forbids."""
    inside_adapters = path.parts[0] == "adapters"
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        modules: list[str] = []
        names: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules, names = [node.module], [alias.name for alias in node.names]
        for module in modules:
            if module.split(".")[0] != "transformers":
                continue
            if not inside_adapters:
                found.append(f"{path}:{node.lineno} imports {module} (only kvshelf.adapters imports transformers)")
            elif module != "transformers":
                found.append(f"{path}:{node.lineno} imports from {module} (a transformers internal: use adapters.hf)")
            for name in set(names) & INTERNAL_NAMES:
                found.append(f"{path}:{node.lineno} imports transformers' {name} (use adapters.hf)")
        if isinstance(node, ast.Attribute) and node.attr in INTERNAL_ATTRIBUTES:
            found.append(f"{path}:{node.lineno} uses .{node.attr} (a transformers internal: use adapters.hf)")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and any(isinstance(a, ast.Constant) and a.value in INTERNAL_ATTRIBUTES for a in node.args)):
            found.append(f"{path}:{node.lineno} reaches a transformers internal through {node.func.id}")
    return found


def test_transformers_internals_only_in_adapters_hf():
    sources = _sources()
    inside = [path for path in sources if BOUNDARY in path.parents]
    assert BOUNDARY / "__init__.py" in inside and len(sources) > 50
    found = [v for path in sources if path not in inside
             for v in violations(path, (REPO_ROOT / path).read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("path", "source"), [
    ("bench/x.py", "def f():\n    from transformers import DynamicCache\n"),
    ("service/x.py", "import transformers\n"),
    ("adapters/x.py", "from transformers.cache_utils import DynamicLayer\n"),
    ("adapters/x.py", "from transformers.masking_utils import sdpa_mask\n"),
    ("adapters/x.py", "from transformers.integrations.sdpa_attention import sdpa_attention_forward\n"),
    ("adapters/x.py", "from transformers import AttentionInterface\n"),
    ("adapters/pruning/x.py", "impl = model.config._attn_implementation\n"),
    ("adapters/x.py", "model.set_attn_implementation('eager')\n"),
    ("reuse/x.py", "impl = getattr(config, '_attn_implementation')\n"),
])
def test_the_scan_catches_each_kind_of_violation(path, source):
    assert violations(Path(path), source)


def test_public_names_in_adapters_pass_the_scan():
    assert not violations(Path("adapters/x.py"), "from transformers import DynamicCache, PreTrainedModel\n")


def test_boundary_states_the_tested_version():
    assert hf.TESTED_VERSION in (hf.__doc__ or "")
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    major, minor, _ = (int(x) for x in hf.TESTED_VERSION.split("."))
    assert f"<{major}.{minor + 1}" in pyproject  # the pin's upper bound admits the tested release, no later one
