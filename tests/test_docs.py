"""The documentation: README.md and the mkdocs site under docs/.

* ``mkdocs build --strict`` passes (every link and anchor resolves, every page is in the nav);
* README.md is at most 200 lines of at most 120 characters;
* every fenced code block of README.md and docs/*.md is either run by this file or marked as a fragment. The
  convention: the line before the opening fence is an HTML comment (invisible in the rendered page) that says
  what the block is:

  - ``<!-- fragment -->``: an excerpt, not run (shell sessions, configuration files, code that needs a model or
    data it does not set up);
  - ``<!-- serve ... -->`` (README only): a ``kvshelf serve`` command, started here on a free loopback port for
    the python blocks after it in the same file;
  - any other comment, or none: a ``python`` block, run here as written in a fresh directory (the README's
    quickstarts load the real SmolLM2 model, so they are ``slow``);
* the settings table of docs/configuration.md is the one ``docs/gen_config.py`` renders from ``ServeConfig``;
* the results tables of docs/benchmarks.md are the ones ``docs/gen_benchmarks.py`` renders from
  bench/results/*.json, and every results file has its table there;
* no page tells build-to-build history ("the build before", "used to", "now"...): the docs say what is.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from helpers import REPO_ROOT
from service_helpers import ServeProcess

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
MAX_README_LINES = 200
MAX_README_WIDTH = 120

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<word>[\w-]+)\b.*-->\s*$")
#: words and phrases of build-to-build history (matched case-insensitively, on word boundaries)
HISTORY = (
    "earlier build", "earlier builds", "the build before", "previous build", "older build", "older builds",
    "this build", "the run before", "used to", "no longer", "then default", "old default", "this session",
    "this task", "lent to", "was lent", "were lent", "before vs", "now",
)
HISTORY_RE = re.compile(r"\b(?:" + "|".join(re.escape(p).replace(r"\ ", r"\s+") for p in HISTORY) + r")\b",
                        re.IGNORECASE)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    info: str  # the fence's info string ("python", "bash", ...)
    marker: str | None  # the word of the HTML comment on the line before the fence
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info else ""


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of the markdown file ``path``, in order."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        marker = MARKER.match(lines[i - 1]) if i else None
        body, j = [], i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"].startswith(fence) and not closing["info"].strip():
                break
            body.append(lines[j][indent:])
            j += 1
        else:
            raise AssertionError(f"{path.relative_to(REPO_ROOT)}:{i + 1}: code block never closed")
        found.append(Block(path, i + 1, opening["info"].strip(), marker["word"] if marker else None,
                           "\n".join(body) + "\n"))
        i = j + 1
    return found


def run_python(block: Block, cwd: Path, replace: dict[str, str] | None = None) -> None:
    """Run ``block`` as a script in ``cwd`` with this interpreter; fail with its output when it fails."""
    code = block.code
    for old, new in (replace or {}).items():
        code = code.replace(old, new)
    script = cwd / "block.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, "-P", str(script)], cwd=cwd, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"{block.where} failed:\n{done.stdout}\n{done.stderr}"


def serve_args(block: Block, data_dir: Path) -> tuple[list[str], str]:
    """The arguments after ``serve`` of the block's ``kvshelf serve`` command, listening on a free loopback port
    and with its data directory under ``data_dir``; and the address the block listens on."""
    words = shlex.split(block.code.replace("\\\n", " "))
    assert "serve" in words and any(w.endswith("kvshelf") for w in words[:words.index("serve")]), (
        f"{block.where}: a serve block holds one `kvshelf serve` command")
    args = words[words.index("serve") + 1:]
    listen = "127.0.0.1:50051"
    for flag, value in (("--listen", "127.0.0.1:0"), ("--data-dir", str(data_dir))):
        if flag in args:
            at = args.index(flag) + 1
            if flag == "--listen":
                listen = args[at]
            args[at] = value
        else:
            args += [flag, value]
    return args, listen


def test_mkdocs_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-P", "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO_ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    for page in PAGES:
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), f"{page.name} was not built"


def test_readme_is_short_and_narrow() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move details into docs/")
    wide = [f"README.md:{n}" for n, line in enumerate(lines, 1) if len(line) > MAX_README_WIDTH]
    assert not wide, f"lines longer than {MAX_README_WIDTH} characters: {wide}"


def test_every_code_block_is_run_or_a_fragment() -> None:
    wrong = []
    for path in [README, *PAGES]:
        for block in blocks(path):
            if block.marker == "fragment":
                continue
            if block.marker == "serve":
                if path != README or block.language not in ("bash", "sh", "shell"):
                    wrong.append(f"{block.where}: a serve block is a bash block of README.md")
                continue
            if block.language != "python":
                wrong.append(f"{block.where}: a {block.language or 'plain'} block must be marked <!-- fragment -->")
                continue
            try:
                compile(block.code, block.where, "exec")
            except SyntaxError as error:
                wrong.append(f"{block.where}: {error}")
    assert not wrong, "code blocks neither run nor marked as fragments:\n" + "\n".join(wrong)


def test_readme_has_its_quickstarts() -> None:
    readme = blocks(README)
    run = [b for b in readme if b.marker not in ("fragment", "serve")]
    assert len(run) >= 3, "README.md: three quickstarts (embedded, RAG, server and worker) run as python blocks"
    assert any(b.marker == "serve" for b in readme), "README.md: the serve quickstart's command is a serve block"
    for needed in ("CachedGenerator", "RAGGenerator", "precompute", "RemoteStore"):
        assert any(needed in b.code for b in run), f"README.md: no quickstart uses {needed}"


def test_no_history_in_the_docs() -> None:
    found = []
    for path in [README, *PAGES]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for match in HISTORY_RE.finditer(line):
                found.append(f"{path.relative_to(REPO_ROOT)}:{n}: {match.group(0)!r}: {line.strip()[:100]}")
    assert not found, "the docs say what is, not how it changed between builds:\n" + "\n".join(found)


def _docs_script(name: str) -> ModuleType:
    """``docs/NAME.py`` (a script, not a package module), loaded by path."""
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_table_is_generated_from_serve_config() -> None:
    gen_config = _docs_script("gen_config")
    page = (DOCS / "configuration.md").read_text()
    assert gen_config.page_table(page) == gen_config.render(), (
        "docs/configuration.md's settings table differs from ServeConfig: run .venv/bin/python docs/gen_config.py")
    from kvshelf.service.config import SECTIONS, SETTINGS

    for spec in SETTINGS:
        assert f"| `{spec.key}` |" in page
    for name in SECTIONS:
        assert f"### `{name}`" in page



def test_benchmark_tables_are_rendered_from_the_results() -> None:
    gen_benchmarks = _docs_script("gen_benchmarks")
    page = (DOCS / "benchmarks.md").read_text()
    assert not gen_benchmarks.problems(page), "\n".join(gen_benchmarks.problems(page))
    assert page == gen_benchmarks.render(page), (
        "docs/benchmarks.md's results tables differ from bench/results/*.json: run .venv/bin/python "
        "docs/gen_benchmarks.py")
    from kvshelf.bench.tables import END, TABLES, result_files

    files = result_files()
    assert files, "no bench/results/*.json"
    for name in files:
        entries = [t for t in TABLES if t.file == name]
        assert entries, f"bench/results/{name} has no table (kvshelf.bench.tables.TABLES)"
        for entry in entries:
            start = page.find(entry.begin)
            assert start >= 0, f"bench/results/{name}: no {entry.begin} in docs/benchmarks.md"
            block = page[start:page.index(END, start)]
            assert block.splitlines()[1].startswith("Machine: "), f"{entry.begin}: the first line names the machine"
            assert "\n|---" in block or "\n|--" in block, f"{entry.begin}: no markdown table"


def test_benchmark_table_to_markdown() -> None:
    from rich.table import Table

    from kvshelf.bench.tables import to_markdown

    table = Table(title="t [green]1[/green]", caption="c")
    table.add_column("name")
    table.add_column("n", justify="right")
    table.add_column("mid", justify="center")
    table.add_row("a|b", "[red]2[/red]", "x *")
    assert to_markdown(table) == ("**t 1**\n\n| name | n | mid |\n|---|---:|:---:|\n| a\\|b | 2 | x \\* |\n\nc")

DOC_PYTHON_BLOCKS = [b for page in PAGES for b in blocks(page) if b.language == "python" and b.marker != "fragment"]


@pytest.mark.parametrize("block", DOC_PYTHON_BLOCKS, ids=[b.where for b in DOC_PYTHON_BLOCKS])
def test_docs_python_blocks_run(block: Block, tmp_path: Path) -> None:
    run_python(block, tmp_path)


def _readme_runs() -> list[tuple[Block, Block | None]]:
    """Each python block of the README to run, with the serve block before it (None: no server)."""
    runs, server = [], None
    for block in blocks(README):
        if block.marker == "serve":
            server = block
        elif block.marker != "fragment" and block.language == "python":
            runs.append((block, server))
    return runs


README_RUNS = _readme_runs()


@pytest.mark.slow
@pytest.mark.parametrize(("block", "server"), README_RUNS, ids=[b.where for b, _ in README_RUNS])
def test_readme_quickstart_runs(block: Block, server: Block | None, tmp_path: Path) -> None:
    """A README quickstart, as written, in a fresh directory (the SmolLM2 model is the one `make install`
    prepared); a worker block runs against the serve block's command, started on a free loopback port."""
    if server is None:
        run_python(block, tmp_path)
        return
    args, listen = serve_args(server, tmp_path / "kv-server")
    assert listen in block.code, f"{block.where}: the worker connects to {listen}, where the server listens"
    served = ServeProcess(*args)
    try:
        run_python(block, tmp_path, replace={listen: served.address})
    finally:
        served.stop()
