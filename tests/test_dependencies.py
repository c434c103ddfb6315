"""Dependencies between the parts point one way (docs/architecture.md, "Layout"), read from the source with ``ast``.

* Module-level imports (not inside a function, not under ``if TYPE_CHECKING:``) form a graph of parts with no
  cycle, and every edge is one the design allows (``ALLOWED``).
* Lazy imports (inside a function, under ``if TYPE_CHECKING:``) point the same way: a part may defer an import to
  keep its own import light, not to reach a part above it. The one exception is the root package's lazy public
  API, which re-exports the parts below the command line (``ROOT_EXPORTS_FROM``).
* The command line (``kvshelf/cli``) is the top: it may import every other part, no part imports it, and its
  modules import only the standard library, typer and rich at module level (``kvshelf --help`` loads no torch);
  ``kvshelf/cli/views`` (what the commands show and run) may import more, and the commands import it lazily.
* Only ``adapters`` imports transformers (``bench`` goes through ``adapters.hf``; internals stay in that one module:
  ``tests/adapters/test_hf_boundary.py``); only ``service`` and ``proto`` (and ``bench``) import grpc: these hold
  for every import, lazy ones too.
* No part imports the test helpers.
* No two files import each other, directly or round a longer loop, lazily or not
  (``test_no_import_cycle_between_files``): a pair that needs each other is one module, or shares a third.

The parts and their folders come from ``pyproject.toml``: its package-dir mapping, and the packages one level under
``kvshelf`` that live in the root package's own folder (``kvshelf.cli``); a new part must be placed here.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvshelf

REPO = Path(__file__).resolve().parent.parent
ROOT = "kvshelf"  # the root package: the lazy public API
CLI = "cli"  # the command line, above every other part

#: part -> the parts its imports may reach, module-level or lazy (``bench``: anything but the command line and the
#: tests; ``cli``: anything but the tests)
ALLOWED: dict[str, set[str]] = {
    ROOT: set(),
    "kvstore": set(),
    "compress": {"kvstore"},
    "reuse": {"compress", "kvstore"},
    "adapters": {"reuse", "compress", "kvstore"},
    "service": {"reuse", "compress", "kvstore", "proto"},
    "proto": set(),
    "bench": {"kvstore", "compress", "reuse", "adapters", "service", "proto"},
    CLI: {"kvstore", "compress", "reuse", "adapters", "service", "proto", "bench"},
}
#: the parts the root package's lazy public API (``kvshelf.__getattr__``) re-exports from
ROOT_EXPORTS_FROM = {"kvstore", "compress", "reuse", "adapters", "service"}
#: what the command line's modules may import at module level, besides the standard library and ``kvshelf.cli``
CLI_MODULE_LEVEL = {"typer", "rich"}
#: modules of other parts the command line may import at module level: the settings of ``kvshelf serve``, whose flags
#: it builds from them (standard library only at module level: ``test_light_modules_import_the_standard_library``)
CLI_LIGHT_MODULES = {"kvshelf.service.config"}
#: what the commands show and run (tables, plots, the demo's job): heavy at module level, so the command modules
#: import it inside the commands only
CLI_VIEWS = "kvshelf.cli.views"
#: third-party top-level modules -> the parts that may import them (any import, lazy or not)
RESTRICTED: dict[str, set[str]] = {
    "transformers": {"adapters"},
    "grpc": {"service", "proto", "bench"},
    "grpc_health": {"service", "proto", "bench"},
    "grpc_reflection": {"service", "proto", "bench"},
    "grpc_tools": {"service", "proto", "bench"},
    "grpc_status": {"service", "proto", "bench"},
    # the RAG frameworks: only in adapters/integrations (and the LangChain chain of bench rag-chain)
    "langchain_core": {"adapters", "bench"},
    "langchain_huggingface": {"adapters"},
    "llama_index": {"adapters"},
    "haystack": {"adapters"},
}
TEST_MODULES = {"tests", "conftest"} | {p.stem for p in (REPO / "tests").glob("*.py")}


@dataclass(frozen=True)
class Import:
    part: str  # the importing part
    where: str  # path:line
    module: str  # the imported module (absolute)
    names: tuple[str, ...]  # for ``from M import a, b``
    module_level: bool


def part_folders() -> dict[str, Path]:
    """part -> folder, from ``[tool.setuptools.package-dir]`` (``kvshelf`` itself is the root package), and the
    packages one level under ``kvshelf`` that package-dir leaves in the root's folder (``kvshelf/cli``)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    folders = {}
    for package, folder in mapping.items():
        part = ROOT if package == ROOT else package.removeprefix(f"{ROOT}.")
        assert "." not in part, f"package-dir maps a nested package {package!r}: the parts are one level deep"
        folders[part] = REPO / folder
    for package in setuptools["packages"]:
        part = package.removeprefix(f"{ROOT}.")
        if package.startswith(f"{ROOT}.") and "." not in part and package not in mapping:
            folders[part] = REPO / mapping[ROOT] / part
    return folders


def _module_name(part: str, folder: Path, path: Path) -> str:
    rel = list(path.relative_to(folder).with_suffix("").parts)
    if rel[-1] == "__init__":
        rel.pop()
    return ".".join([ROOT, *rel] if part == ROOT else [ROOT, part, *rel])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(nodes: list[ast.stmt], module_level: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``nodes``, with whether it runs when the module is imported."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, module_level
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _walk(node.body, False)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, False)
            yield from _walk(node.orelse, module_level)
        else:  # classes, try/except, with, for, if ...: their bodies run at import time
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, None) or []:
                    inner = child.body if isinstance(child, ast.ExceptHandler | ast.match_case) else [child]
                    yield from _walk(inner, module_level)


def imports() -> list[Import]:
    found = []
    for part, folder in part_folders().items():
        paths = [folder / "__init__.py"] if part == ROOT else sorted(folder.rglob("*.py"))
        for path in paths:
            if "__pycache__" in path.parts:
                continue
            module = _module_name(part, folder, path)
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for node, module_level in _walk(ast.parse(path.read_text(), str(path)).body, True):
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        found.append(Import(part, where, alias.name, (), module_level))
                    continue
                target = node.module or ""
                if node.level:  # relative (ruff bans them; resolved all the same)
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join([*base, target] if target else base)
                found.append(Import(part, where, target, tuple(a.name for a in node.names), module_level))
    return found


def target_parts(imp: Import) -> set[str]:
    """The parts an import reaches: ``kvshelf.X...`` is part X; ``from kvshelf import NAME`` is the part of X when
    NAME is a part, or of the module that defines the public NAME; ``import kvshelf`` alone reaches none."""
    pieces = imp.module.split(".")
    if pieces[0] != ROOT:
        return set()
    if len(pieces) > 1:
        return {pieces[1]}
    parts = set()
    for name in imp.names:
        if name in ALLOWED:
            parts.add(name)
        elif name in kvshelf._EXPORTS:
            parts.add(kvshelf._EXPORTS[name].split(".")[1])
    return parts


def part_graph(lazy: bool = False) -> dict[tuple[str, str], list[Import]]:
    """(from part, to part) -> the module-level imports that make that edge (self-edges left out); with ``lazy``,
    the lazy imports instead."""
    edges: dict[tuple[str, str], list[Import]] = {}
    for imp in imports():
        if imp.module_level != lazy:
            for to in target_parts(imp) - {imp.part}:
                edges.setdefault((imp.part, to), []).append(imp)
    return edges


def module_names() -> dict[str, Path]:
    """Every module of the package (``kvshelf.kvstore.store``, packages by their ``__init__``) -> its file."""
    found = {}
    for part, folder in part_folders().items():
        paths = [folder / "__init__.py"] if part == ROOT else sorted(folder.rglob("*.py"))
        for path in paths:
            if "__pycache__" not in path.parts:
                found[_module_name(part, folder, path)] = path
    return found


def module_graph() -> dict[tuple[str, str], list[Import]]:
    """(importing module, imported module) -> the imports that make that edge, module-level and lazy alike, between
    the package's own modules. ``from P import N`` reaches the module ``P.N`` when there is one, else ``P``."""
    modules = module_names()
    by_path = {str(path.relative_to(REPO)): name for name, path in modules.items()}
    edges: dict[tuple[str, str], list[Import]] = {}
    for imp in imports():
        source = by_path[imp.where.rpartition(":")[0]]
        targets = {f"{imp.module}.{n}" if f"{imp.module}.{n}" in modules else imp.module for n in imp.names}
        for target in (targets or {imp.module}) & modules.keys() - {source}:
            edges.setdefault((source, target), []).append(imp)
    return edges


def _in_views(where: str) -> bool:
    return where.startswith(CLI_VIEWS.replace(".", "/").removeprefix(f"{ROOT}/").join([f"{ROOT}/", "/"]))


def _show(imp: Import) -> str:
    names = f" import {', '.join(imp.names)}" if imp.names else ""
    return f"{imp.where}: {'from ' if imp.names else 'import '}{imp.module}{names}"


def find_cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    """A cycle of parts (first part repeated at the end), or None."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_part_has_a_rule() -> None:
    assert set(part_folders()) == set(ALLOWED), "a part was added or removed: give it its ALLOWED entry"
    for part, folder in part_folders().items():
        assert (folder / "__init__.py").is_file(), f"{part}: {folder} has no __init__.py"


def test_the_scan_sees_imports() -> None:
    """The scanner finds known edges and knows lazy from module-level (a guard against checking nothing)."""
    edges = part_graph()
    assert ("compress", "kvstore") in edges and ("service", "proto") in edges and ("adapters", "kvstore") in edges
    assert any(not i.module_level and i.module.startswith("grpc") for i in imports())
    lazy = part_graph(lazy=True)
    assert (CLI, "bench") in lazy and (CLI, "service") in lazy and (ROOT, "adapters") in lazy
    assert any(i.where.startswith("kvshelf/cli/") for i in imports()), "the command line's modules were not read"


def test_no_import_cycle_between_parts() -> None:
    edges = part_graph()
    cycle = find_cycle(set(edges))
    if cycle:
        lines = [f"import cycle between parts: {' -> '.join(cycle)}"]
        for a, b in zip(cycle, cycle[1:], strict=False):
            made_by = edges[(a, b)]
            lines += [f"  {a} -> {b}:"] + [f"    {_show(i)}" for i in made_by[:5]]
            lines += [f"    ... and {len(made_by) - 5} more"] if len(made_by) > 5 else []
        pytest.fail("\n".join(lines))


def test_no_import_cycle_between_files() -> None:
    """Two modules that import each other (lazily too: a deferred import hides the loop, it does not remove it)
    cannot be read, tested or moved one without the other."""
    edges = module_graph()
    assert ("kvshelf.kvstore.store", "kvshelf.kvstore.keys") in edges, "the module scan found no known edge"
    cycle = find_cycle(set(edges))
    if cycle:
        lines = [f"import cycle between files: {' -> '.join(cycle)}"]
        for a, b in zip(cycle, cycle[1:], strict=False):
            lines += [f"  {_show(i)}" for i in edges[(a, b)][:3]]
        pytest.fail("\n".join(lines))


def test_dependencies_point_one_way() -> None:
    broken = []
    for (a, b), made_by in sorted(part_graph().items()):
        if b not in ALLOWED[a]:
            allowed = ", ".join(sorted(ALLOWED[a])) or "no other part"
            broken.append(f"{a} -> {b} is not allowed ({a} may import {allowed} at module level):")
            broken += [f"    {_show(i)}" for i in made_by]
    assert not broken, "module-level imports against the design's direction (make them lazy, or move code):\n" + (
        "\n".join(broken))


def test_lazy_imports_point_one_way() -> None:
    """A lazy import still reaches its part when the function runs: it may defer a part below, never reach one
    above (``service`` reaching ``bench``, ``adapters`` reaching ``service``), else the layers are one in practice."""
    broken = []
    for (a, b), made_by in sorted(part_graph(lazy=True).items()):
        allowed = ROOT_EXPORTS_FROM if a == ROOT else ALLOWED[a]
        if b not in allowed:
            reach = ", ".join(sorted(allowed)) or "no other part"
            broken.append(f"{a} -> {b} is not allowed ({a} may import {reach}):")
            broken += [f"    {_show(i)}" for i in made_by]
    assert not broken, "lazy imports against the design's direction (move the code up or down):\n" + "\n".join(broken)


def test_no_part_imports_the_command_line() -> None:
    wrong = [f"{_show(i)} (part {i.part})" for i in imports() if i.part != CLI and CLI in target_parts(i)]
    assert not wrong, "the command line is the top: nothing imports it (lazily or not):\n" + "\n".join(wrong)


def test_the_command_line_is_light_at_module_level() -> None:
    """``kvshelf --help`` imports every module of ``kvshelf/cli``: at module level they import the standard library,
    typer, rich and each other only; the store, the models and torch come inside the commands that use them
    (``tests/test_cli_imports.py`` runs it)."""
    wrong = [_show(i) for i in imports() if i.part == CLI and i.module_level and not _in_views(i.where)
             and not (i.module == "__future__" or i.module.split(".")[0] in sys.stdlib_module_names | CLI_MODULE_LEVEL
                      or (i.module == f"{ROOT}.{CLI}" and CLI_VIEWS.rpartition(".")[2] not in i.names)
                      or (i.module.startswith(f"{ROOT}.{CLI}.") and not i.module.startswith(CLI_VIEWS))
                      or i.module in CLI_LIGHT_MODULES)]
    assert not wrong, "module-level imports of the command line that load more than it needs for --help:\n" + (
        "\n".join(wrong))


def test_light_modules_import_the_standard_library() -> None:
    """What the command line imports of other parts at module level (``CLI_LIGHT_MODULES``) imports only the
    standard library at module level."""
    for module in CLI_LIGHT_MODULES:
        path = REPO / part_folders()[module.split(".")[1]] / (module.split(".")[-1] + ".py")
        tree = ast.parse(path.read_text())
        names = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
        names += [node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom) and node.level == 0]
        wrong = [name for name in names if name != "__future__" and name.split(".")[0] not in sys.stdlib_module_names]
        assert not wrong, f"{module} imports {wrong} at module level"


def test_kvstore_imports_no_other_part_at_module_level() -> None:
    """The base of everything (its codec registry imports ``kvshelf.compress`` on the first lookup)."""
    wrong = [_show(i) for (a, _), made_by in part_graph().items() if a == "kvstore" for i in made_by]
    assert not wrong, "kvstore imports another part at module level:\n" + "\n".join(wrong)


@pytest.mark.parametrize("library", sorted(RESTRICTED))
def test_restricted_libraries(library: str) -> None:
    wrong = [f"{_show(i)} (part {i.part})" for i in imports()
             if i.module.split(".")[0] == library and i.part not in RESTRICTED[library]]
    allowed = ", ".join(sorted(RESTRICTED[library]))
    assert not wrong, f"only {allowed} may import {library}; found:\n" + "\n".join(wrong)


def test_no_part_imports_the_tests() -> None:
    wrong = [_show(i) for i in imports() if i.module.split(".")[0] in TEST_MODULES]
    assert not wrong, "the package must not import test helpers:\n" + "\n".join(wrong)


def test_find_cycle_reports_the_path() -> None:
    assert find_cycle({("a", "b"), ("b", "c")}) is None
    assert find_cycle({("a", "b"), ("b", "c"), ("c", "a")}) == ["a", "b", "c", "a"]
